"""Recipes wired to the mixture-of-experts families (issue 27, item 5).

For each family a tiny random checkpoint folder is written the way a Hugging Face release is laid
out (the family's transformers config and model, ``save_pretrained``, the family's real chat template
from shared/fixtures as tokenizer_config's ``chat_template``, a byte-level tokenizer holding the
template's and the parser's markup as added single tokens) and loaded through
`helios.runtime.build_runtime`, the server's load path. The recipe and output parser it chose are
checked, then the family's real raw output (shared/fixtures/outputs) is tokenized with that tokenizer
and its ids go, one engine step per token, through the serving output path (the Service's parser
factory for a rendered prompt, `OutputProcessor` with the tokenizer's incremental detokenizer), which
must yield the fixture's reasoning and tool calls.

The folders are named neutrally ("checkpoint"), so the model-id rules of `detect_recipe` never fire:
what is selected comes from the architecture (config.json) and the template.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
import trio

from helios.config import EngineSection, HeliosConfig, ModelConfigSection, ServerConfig
from helios.domain.conversation import ConversationRequest, Message, TextPart, Tool
from helios.domain.events import OutputEvent, ReasoningDelta, TextDelta, ToolCall
from helios.engine.records import EngineFinish, RequestOutput
from helios.recipes import get_recipe
from helios.runtime import Runtime, build_runtime
from helios.serving.output import OutputProcessor
from helios.serving.service_factory import make_service
from tests.shared_fixtures import shared_fixtures

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

TEMPLATES = shared_fixtures("chat_templates")
OUTPUTS = shared_fixtures("outputs")
pytestmark = pytest.mark.skipif(TEMPLATES is None or OUTPUTS is None,
                                reason="shared/fixtures/chat_templates or outputs not found")

VOCAB = 272  # 256 byte tokens + up to 16 added tokens


def _tiny(kind: str) -> torch.nn.Module:
    """The family's tiny random transformers model (the parity tests' configurations)."""
    if kind in ("qwen3_moe", "glm4_moe"):
        from tests.parity.test_moe_parity import _tiny_hf_model as moe
        return moe("qwen3" if kind == "qwen3_moe" else "glm")
    if kind == "minimax_m2":
        from tests.parity.test_minimax_m2_parity import _tiny_hf_model as minimax
        return minimax("full-tied")
    if kind == "gpt_oss":
        from tests.parity.test_gpt_oss_parity import _tiny_hf_model as gpt_oss
        return gpt_oss("plain")
    if kind == "mimo_v2_flash":
        from tests.parity.test_mimo_v2_flash_parity import _tiny_hf_model as mimo
        return mimo()
    from tests.parity.test_gemma4_parity import _tiny_hf_model as gemma4
    return gemma4("moe")


@attrs.frozen
class Case:
    kind: str  # HF model_type (= the helios registry name)
    template: str  # shared/fixtures/chat_templates/<template>.jinja
    output: str  # shared/fixtures/outputs/<output>.txt
    recipe: str
    parser: str
    special: tuple[str, ...]  # role / end tokens (special: they decode to nothing)
    markup: tuple[str, ...]  # reasoning and tool markup (added, not special: they decode to their text)
    eos: tuple[str, ...]
    calls_parsed: bool = True


THINK_TOOLS = ("<think>", "</think>", "<tool_call>", "</tool_call>")
CHATML = ("<|im_start|>", "<|im_end|>", "<|endoftext|>")
GLM_SPECIAL = ("[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>", "<|endoftext|>")
GLM_MARKUP = (*THINK_TOOLS, "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")
HARMONY = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>")
GEMMA4_MARKUP = ("<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>", '<|"|>', "<|tool_response>",
                 "<tool_response|>")

CASES = [
    # qwen3_moe: no architecture rule (Qwen3-30B-A3B writes Hermes JSON, Qwen3-Coder-30B-A3B function
    # tags); `plain` with the parser its template implies.
    Case("qwen3_moe", "qwen3", "qwen3", "plain", "qwen3", CHATML, THINK_TOOLS, ("<|im_end|>",)),
    Case("qwen3_moe", "qwen3_coder", "qwen3_coder", "plain", "qwen3_coder", CHATML, THINK_TOOLS, ("<|im_end|>",)),
    Case("glm4_moe", "glm4_6", "glm4_6", "glm53", "glm", GLM_SPECIAL, GLM_MARKUP, ("<|user|>", "<|observation|>")),
    Case("glm4_moe", "glm4_7_flash", "glm4_7", "glm53", "glm", GLM_SPECIAL, GLM_MARKUP,
         ("<|user|>", "<|observation|>")),
    Case("minimax_m2", "minimax_m2", "minimax_m2", "minimax_m3", "minimax_m2", ("]~!b[", "[e~[", "]~b]"),
         ("<think>", "</think>", "<minimax:tool_call>", "</minimax:tool_call>"), ("[e~[",)),
    # gpt_oss: the catalog has no harmony recipe; `plain` with the harmony parser. The markup tokens are
    # visible (llama.cpp keeps them so); <|return|> and <|call|> end a turn, as gpt-oss's
    # generation_config says.
    Case("gpt_oss", "gpt_oss", "gpt_oss", "plain", "harmony", ("<|endoftext|>",), HARMONY,
         ("<|return|>", "<|call|>")),
    # mimo_v2_flash: the fixtures hold no MiMo-V2 template or output; MiMo-VL's stand in. Its Hermes
    # JSON calls are not MiMo V2's function-tag syntax, so only the reasoning is parsed.
    Case("mimo_v2_flash", "mimo_vl", "mimo", "mimo_v2", "mimo", CHATML, THINK_TOOLS, ("<|im_end|>",),
         calls_parsed=False),
    Case("gemma4", "gemma4", "gemma4", "gemma4", "gemma4", ("<bos>", "<eos>", "<|turn>", "<turn|>"),
         GEMMA4_MARKUP, ("<turn|>",)),
]

TOOLS = (
    Tool("get_weather", "The weather in a city", {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city"],
    }),
    Tool("get_time", "The time in a timezone", {
        "type": "object", "properties": {"timezone": {"type": "string"}}, "required": ["timezone"],
    }),
)
EXPECTED_CALLS = {
    "one_call": [("get_weather", {"city": "Paris", "unit": "celsius"})],
    "two_calls": [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"timezone": "Europe/Paris"})],
}
EXPECTED_REASONING = {
    "one_call": "The user wants the weather in Paris. I should call get_weather.",
    "two_calls": "The user wants the weather and the local time in Paris. I will call get_weather and get_time.",
}


def _byte_level_backend(case: Case) -> Any:
    """One token per byte (no merges), then the family's tokens as added single tokens."""
    keep = [b for b in range(256) if 33 <= b <= 126 or 161 <= b <= 172 or 174 <= b <= 255]
    spelled = {b: chr(b) for b in keep}
    for offset, b in enumerate(b for b in range(256) if b not in spelled):
        spelled[b] = chr(256 + offset)
    backend = tokenizers.Tokenizer(tokenizers.models.BPE(vocab={spelled[b]: b for b in range(256)}, merges=[]))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = tokenizers.decoders.ByteLevel()
    backend.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False) for t in case.special])
    backend.add_tokens([tokenizers.AddedToken(t, special=False, normalized=False)
                        for t in case.markup if t not in case.special])
    assert backend.get_vocab_size(with_added_tokens=True) <= VOCAB
    return backend


def write_checkpoint(root: Path, case: Case) -> Path:
    assert TEMPLATES is not None
    model = _tiny(case.kind)
    model.save_pretrained(root, safe_serialization=True)
    backend = _byte_level_backend(case)
    backend.save(str(root / "tokenizer.json"))
    template = (TEMPLATES / f"{case.template}.jinja").read_text(encoding="utf-8")
    (root / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": template, "eos_token": case.eos[0], "add_bos_token": False,
        **({"bos_token": "<bos>"} if "<bos>" in case.special else {}),
    }))
    eos_ids = [backend.token_to_id(t) for t in case.eos]
    (root / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_ids}))
    return root


def serving_config(path: Path) -> HeliosConfig:
    return HeliosConfig(
        server=ServerConfig(default_max_tokens=16, access_log=False),
        model=ModelConfigSection(path=str(path), dtype="float32", weights="float32", weight_cache=False,
                                 max_model_len=256, threads=1),
        engine=EngineSection(page_size=16, kv_pages=32, prefill_chunk_size=256, max_active=2),
    )


def load_samples(name: str) -> dict[str, str]:
    assert OUTPUTS is not None
    body = (OUTPUTS / f"{name}.txt").read_text(encoding="utf-8").split("\n<<<END>>>", 1)[0]
    parts = re.split(r"(?:^|\n)<<<SAMPLE (\w+)>>>\n", body)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts), 2)}


def conversation() -> ConversationRequest:
    return ConversationRequest(messages=(Message("user", (TextPart("Weather and time in Paris?"),)),), tools=TOOLS)


def replay(rt: Runtime, text: str) -> tuple[list[int], list[OutputEvent]]:
    """The sample's ids, one engine step each, through the Service's parser and `OutputProcessor`;
    the turn ends on the sample's own last token when it is an EOS id, else on an appended EOS."""
    service = make_service(rt)
    conv = conversation()
    prompt, _ = trio.run(service.render_chat, conv)  # the template renders the tools: native tool support
    factory: Callable[[], Any] | None = service.parser_factory(conv, prompt)
    assert factory is not None
    tok = rt.tokenizer
    ids = tok.encode(text, add_special_tokens=False)
    steps = ids if ids[-1] in rt.eos_token_ids else [*ids, rt.eos_token_ids[0]]
    proc = OutputProcessor(tok.incremental_detokenizer(), parser=factory())
    events: list[OutputEvent] = []
    for n, tid in enumerate(steps):
        last = n == len(steps) - 1
        update = proc.process(RequestOutput("r", (tid,), finish=EngineFinish.EOS if last else None))
        events += update.events
    assert proc.finished is not None and proc.finished.error is None, proc.finished
    return ids, events


@pytest.fixture(scope="module")
def runtimes(tmp_path_factory: pytest.TempPathFactory) -> dict[Case, Runtime]:
    torch_threads = torch.get_num_threads()
    loaded = {}
    try:
        for case in CASES:
            root = write_checkpoint(tmp_path_factory.mktemp("checkpoint"), case)
            loaded[case] = build_runtime(serving_config(root))
    finally:
        torch.set_num_threads(torch_threads)  # build_runtime sets one thread for the main thread
    return loaded


@pytest.mark.parametrize("case", CASES, ids=[f"{c.kind}-{c.template}" for c in CASES])
def test_load_selects_the_family_recipe(case: Case, runtimes: dict[Case, Runtime]) -> None:
    rt = runtimes[case]
    assert rt.info.model_id.startswith("checkpoint")  # no model-id rule can have fired
    assert rt.recipe.name == case.recipe
    assert rt.recipe.output_parser == case.parser
    assert rt.info.recipe == case.recipe
    if case.recipe != "plain":  # the catalog's sampling defaults and ranges, not generation_config's
        expected = get_recipe(case.recipe)
        assert rt.recipe == expected
        assert rt.info.sampling_defaults == expected.sampling_defaults_json()
        assert rt.info.sampling_ranges == expected.sampling_ranges_json()
    assert rt.info.has_reasoning


@pytest.mark.parametrize("case", CASES, ids=[f"{c.kind}-{c.output}" for c in CASES])
def test_real_output_token_ids_through_the_chosen_parser(case: Case, runtimes: dict[Case, Runtime]) -> None:
    rt = runtimes[case]
    tok = rt.tokenizer
    for sample, text in load_samples(case.output).items():
        ids, events = replay(rt, text)
        for marker in case.markup:  # the markup really is single tokens in these ids
            if marker in text:
                assert tok.token_to_id(marker) in ids, marker
        reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
        answer = "".join(e.text for e in events if isinstance(e, TextDelta))
        calls = [(e.name, json.loads(e.arguments)) for e in events if isinstance(e, ToolCall)]
        if case.output == "qwen3_coder":  # Qwen3-Coder does not think; a preamble precedes the calls
            assert reasoning == ""
            assert answer.startswith("I'll look up the")
        else:
            assert reasoning.strip() == EXPECTED_REASONING[sample], (sample, reasoning)
        if case.calls_parsed:
            assert calls == EXPECTED_CALLS[sample], (sample, events)
            if case.output != "qwen3_coder":
                assert answer.strip() == "", (sample, answer)
        else:
            assert calls == []
