"""A new architecture served end to end through the registry, with no change in the runner, the
scheduler, the KV cache manager or the loaders.

The architecture is test-only: the synthetic hybrid decoder of `tests/unit/hybrid_model.py` (a
full-attention layer, two sliding-window layers and a recurrent-state layer). It is registered from
this test (`models.registry.registered`), written as a Hugging Face folder (config.json with its own
``model_type``, safetensors weights, a byte-level tokenizer and a chat template), and served by the
real app (`helios.runtime.build_runtime`: the checkpoint loader finds the entry, the entry builds
the module, the engine sizes its caches from the module's cache specs) behind hypercorn on a real
socket. The OpenAI SDK's greedy answers, with their token ids, are checked against the independent
float64 full-sequence reference of `tests/unit/test_hybrid_cache.py`, for prompts longer than the
sliding window, decoded well past it, and for two requests at once.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
from safetensors.torch import save_file
from torch import Tensor

from helios.app import HeliosApp
from helios.config import EngineSection, HeliosConfig, ModelConfigSection, ServerConfig
from helios.models import registry
from helios.models.architecture import Architecture, BuildOptions
from tests.serving.harness import AppServer
from tests.unit.hybrid_model import DEFAULT_CONFIG, HybridModel
from tests.unit.test_hybrid_cache import reference_logprobs

pytestmark = pytest.mark.slow

MODEL_TYPE = "helios_test_hybrid"
SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
VOCAB = 256 + len(SPECIAL)
CONFIG = {**DEFAULT_CONFIG, "vocab_size": VOCAB, "window": 6, "seed": 3}
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@attrs.frozen(kw_only=True)
class HybridConfig:
    """The registry's view of the synthetic model's config.json."""

    arch: str
    vocab_size: int
    max_position_embeddings: int
    values: tuple[tuple[str, Any], ...]

    def projection_params(self) -> int:
        return 0


class ServedHybrid(HybridModel):
    """The synthetic model with what the loaders and the runtime call (`LoadableCausalLM`)."""

    def load_weights(self, tensors: Mapping[str, Any]) -> None:
        params = dict(self.named_parameters())
        if set(tensors) != set(params):
            raise ValueError(f"weights do not match: {sorted(set(tensors) ^ set(params))[:4]}")
        with torch.no_grad():
            for name in tensors:
                params[name].copy_(tensors[name])

    def packed_state(self) -> tuple[dict[str, Tensor], dict[str, str]]:
        return {name: p.detach() for name, p in self.named_parameters()}, {}

    def load_packed_state(self, state: Mapping[str, Tensor], kinds: Mapping[str, str]) -> None:
        self.load_weights(state)

    def pack_cpu_weights(self) -> int:
        return 0

    @property
    def head_format(self) -> str:
        return "float32"

    @property
    def head_bf16_rows(self) -> int | None:
        return None


def _config_from_hf(config: Mapping[str, Any]) -> HybridConfig:
    values = {k: (tuple(v) if isinstance(v, list) else v) for k, v in config.items() if k in DEFAULT_CONFIG}
    return HybridConfig(arch=MODEL_TYPE, vocab_size=int(config["vocab_size"]),
                        max_position_embeddings=int(config["max_positions"]), values=tuple(sorted(values.items())))


def _build(config: Any, options: BuildOptions) -> ServedHybrid:
    assert isinstance(config, HybridConfig)
    return ServedHybrid({**dict(config.values), "seed": 12345})  # weights come from the checkpoint


ARCH = Architecture(name=MODEL_TYPE, hf_model_types=(MODEL_TYPE,), hf_architectures=("HeliosTestHybrid",),
                    config_from_hf=_config_from_hf, build=_build)


def _write_checkpoint(root: Path, model: HybridModel) -> Path:
    tokenizers = pytest.importorskip("tokenizers")
    root.mkdir()
    (root / "config.json").write_text(json.dumps({"model_type": MODEL_TYPE, "architectures": ["HeliosTestHybrid"],
                                                  **{k: list(v) if isinstance(v, tuple) else v
                                                     for k, v in CONFIG.items()}}))
    save_file({name: p.detach().contiguous() for name, p in model.named_parameters()}, str(root / "model.safetensors"))
    # Byte-level BPE without merges: token id b is byte b; the specials follow.
    keep = [b for b in range(256) if 33 <= b <= 126 or 161 <= b <= 172 or 174 <= b <= 255]
    spelled = {b: chr(b) for b in keep}
    for offset, b in enumerate(b for b in range(256) if b not in spelled):
        spelled[b] = chr(256 + offset)
    backend = tokenizers.Tokenizer(tokenizers.models.BPE(vocab={spelled[b]: b for b in range(256)}, merges=[]))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = tokenizers.decoders.ByteLevel()
    backend.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    backend.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>", "chat_template": TEMPLATE}))
    return root


def _greedy_reference(model: HybridModel, prompt: Sequence[int], n: int) -> list[int]:
    ids = list(prompt)
    out: list[int] = []
    for _ in range(n):
        token = int(reference_logprobs(model, ids)[-1].argmax())
        out.append(token)
        ids.append(token)
    return out


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[AppServer, HybridModel]]:
    model = HybridModel(CONFIG).eval()
    path = _write_checkpoint(tmp_path_factory.mktemp("hybrid") / "checkpoint", model)
    cfg = HeliosConfig(
        server=ServerConfig(aliases=["hybrid"], max_concurrency=8, frontend_workers=2),
        model=ModelConfigSection(path=str(path), dtype="float32", weights="float32", weight_cache=False,
                                 max_model_len=400),
        engine=EngineSection(page_size=4, kv_pages=256, prefill_chunk_size=16, max_active=4),
    )
    with registry.registered(ARCH):
        server = AppServer(HeliosApp(cfg), "hybrid").start()
        try:
            yield server, model
        finally:
            server.stop()


def _chat(server: AppServer, text: str, max_tokens: int) -> Any:
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    return client.chat.completions.create(
        model="hybrid", messages=[{"role": "user", "content": text}], temperature=0, max_tokens=max_tokens,
        extra_body={"return_token_ids": True, "ignore_eos": True})


def test_the_registered_architecture_is_served_and_listed(served: tuple[AppServer, HybridModel]) -> None:
    server, _ = served
    with server.http() as http:
        models = http.get("/v1/models").json()
    assert [m["id"] for m in models["data"]][:1] == ["hybrid"]
    assert models["data"][0]["max_model_len"] == 400


def test_greedy_answers_equal_the_float64_reference(served: tuple[AppServer, HybridModel]) -> None:
    server, model = served
    # The rendered prompt is ~40 tokens (past the 6-token window and across several 16-token
    # prefill chunks); 24 decoded tokens run the sliding layers' page release and the recurrent state.
    answer = _chat(server, "Tell me about windows and states, briefly.", 24)
    choice = answer.choices[0].model_dump()
    prompt, tokens = answer.model_dump()["prompt_token_ids"], choice["token_ids"]
    assert len(prompt) > 3 * CONFIG["window"] and len(tokens) == 24
    assert answer.choices[0].finish_reason == "length"
    assert tokens == _greedy_reference(model, prompt, 24)


def test_concurrent_requests_each_equal_their_reference(served: tuple[AppServer, HybridModel]) -> None:
    server, model = served
    texts = ["A first request, somewhat longer than the other one.", "Second."]
    results: dict[int, Any] = {}

    def ask(i: int) -> None:
        results[i] = _chat(server, texts[i], 16)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(texts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    for i in range(len(texts)):
        body = results[i].model_dump()
        assert body["choices"][0]["token_ids"] == _greedy_reference(model, body["prompt_token_ids"], 16), texts[i]


def test_helios_serve_of_an_unknown_architecture_fails_in_one_line(tmp_path: Path) -> None:
    import subprocess
    import sys

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "foo", "architectures": ["FooForCausalLM"]}))
    proc = subprocess.run([sys.executable, "-m", "helios.cli", "serve", str(tmp_path), "--port", "0"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "unsupported architecture" in line]
    assert len(lines) == 1, proc.stderr
    assert "'foo'" in lines[0] and "supported: " in lines[0] and "qwen2" in lines[0]
