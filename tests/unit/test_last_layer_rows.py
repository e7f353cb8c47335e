"""The model's ``keep`` rows: the last decoder layer's o projection, norm and MLP run for the rows
whose logits are read (the runner's sampled rows), and no other; the answers do not change."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from helios.domain.sampling import SamplingParams
from helios.engine.core import EngineConfig, EngineCore
from helios.engine.records import EngineRequest
from helios.runtime import load_model
from tests.unit.tiny_gguf import write_tiny_gguf

Run = dict[str, tuple[list[int], list[float], int]]  # request id -> (tokens, logprobs, scored prompt positions)


def _generate(loaded: Any, prompts: dict[str, tuple[int, ...]], *, chunk: int, score: str | None = None) -> Run:
    core = EngineCore(loaded.model,
                      EngineConfig(page_size=4, num_pages=64, max_active=4, prefill_chunk_size=chunk,
                                   max_model_len=128), loaded.choice.dtype, "cpu")
    for rid, prompt in prompts.items():
        core.add(EngineRequest(rid, prompt, SamplingParams(temperature=0.0), max_tokens=4, ignore_eos=True,
                               num_top_logprobs=0, prompt_logprobs=0 if rid == score else None))
    out: Run = {}
    with torch.inference_mode():
        while core.scheduler.has_work:
            for o in core.step():
                ids, lps, scored = out.setdefault(o.request_id, ([], [], 0))
                ids.extend(o.new_token_ids)
                lps.extend(lp.logprob for lp in (o.logprobs or ()))
                out[o.request_id] = (ids, lps, scored + len(o.prompt_logprobs or ()))
    return out


@pytest.mark.parametrize(("weights", "tolerance"), [("float32", 1e-4), ("auto", 2e-2)])
def test_the_last_layer_runs_its_mlp_for_the_sampled_rows_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                weights: str, tolerance: float) -> None:
    """Rows through each layer's down projection, per step: every token in the first layer, only the
    sampled rows in the last (none for a prefill chunk that ends no prompt, every prompt row for a
    request that scores its prompt). The greedy tokens are those of the whole-batch path (the model
    without ``keep``, rows selected afterwards); the logprobs agree within the format's tolerance (fewer
    rows may take another kernel: auto's int4 codes below its dense threshold, in bfloat16)."""
    loaded = load_model(write_tiny_gguf(tmp_path / "tiny.gguf"), weights=weights)
    model = loaded.model
    first, last = model.layers[0].down_proj, model.layers[-1].down_proj
    seen: dict[str, list[int]] = {"first": [], "last": []}
    hooks = [first.register_forward_hook(lambda _m, args, _o: seen["first"].append(args[0].shape[0])),
             last.register_forward_hook(lambda _m, args, _o: seen["last"].append(args[0].shape[0]))]
    prompts = {"a": tuple(range(3, 14)), "b": tuple(range(20, 25))}
    try:
        # One step prefills both prompts (16 tokens); the last layer sees their last rows only.
        kept = _generate(loaded, prompts, chunk=64)
        assert seen["first"][0] == 16 and seen["last"][0] == 2
        # Decode steps sample every row (they run as `decode_layers`, past these modules, where it applies).
        assert seen["first"][1:] == seen["last"][1:] and set(seen["last"][1:]) <= {2}
        # Chunks of 4 prompt tokens: the chunks that end no prompt have no sampled row, and no MLP row.
        seen["first"].clear(), seen["last"].clear()
        chunked = _generate(loaded, {"a": prompts["a"]}, chunk=4)
        assert seen["first"][:3] == [4, 4, 3] and seen["last"][0] == 1
        assert len(seen["last"]) == len(seen["first"]) - 2
        # A request that scores its prompt reads every prompt row's logits: all rows go through.
        seen["first"].clear(), seen["last"].clear()
        scored = _generate(loaded, prompts, chunk=64, score="a")
        assert seen["first"][0] == seen["last"][0] == 16
        assert scored["a"][2] == len(prompts["a"])
    finally:
        for hook in hooks:
            hook.remove()

    real = model.forward

    def whole(input_ids: torch.Tensor, positions: torch.Tensor, attn: Any, *, embeds: Any = None,
              keep: torch.Tensor | None = None) -> torch.Tensor:
        hidden = real(input_ids, positions, attn, embeds=embeds)
        return hidden if keep is None else hidden.index_select(0, keep)

    monkeypatch.setattr(model, "forward", whole)
    for run, reference in ((kept, _generate(loaded, prompts, chunk=64)),
                           (chunked, _generate(loaded, {"a": prompts["a"]}, chunk=4)),
                           (scored, _generate(loaded, prompts, chunk=64, score="a"))):
        assert run.keys() == reference.keys()
        for rid, (ids, lps, n) in run.items():
            assert ids == reference[rid][0] and n == reference[rid][2] and len(ids) == 4
            assert max(abs(a - b) for a, b in zip(lps, reference[rid][1], strict=True)) < tolerance
