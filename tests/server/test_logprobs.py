"""Generation and prompt logprobs over HTTP against an independent float64 reference.

Every logprob a live server returns (Chat, Completions, Responses; generated positions, echoed prompt
positions and prompt_logprobs) is compared with transformers reading the same weights in float64:
values within `TOLERANCE`, natural alternatives equal to the true top-k in the spec's order
(decreasing logprob, increasing id; positions whose fp64 values are closer than the tolerance may
swap), and prompt ranks equal to the fp64 rank (or inside the window such near-ties allow).

Two models: the default GGUF (transformers dequantizes it to float64) on the shared `server`, and a
tiny random Llama written with `save_pretrained` and served in float32 with a small prefill chunk,
so prompt scores cross several chunks. The OpenAI SDK must parse every logprob response shape.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Iterator, Sequence
from typing import Any

import httpx
import pytest
import torch

from tests.server.conftest import EXTERNAL, LiveServer, start_server, stop_server

pytestmark = pytest.mark.slow

TOLERANCE = 1e-4
MAX_DIFF: dict[str, float] = {}  # the largest |server - fp64| seen per model, printed at the end

LONG_TEXT = " ".join(
    f"Section {i}: the river town kept {i * 7 % 13} boats, {i * 3 % 11} mills and a library of {100 + i} books."
    for i in range(14)
)  # about 300 tokens: the default server's 256-token prefill chunk splits it


class Reference:
    """Float64 log-softmax of one model over whole token sequences (row p predicts token p + 1)."""

    def __init__(self, model: Any, name: str) -> None:
        self.model = model
        self.name = name

    def __call__(self, ids: Sequence[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = self.model(torch.tensor([list(ids)])).logits[0].double()
        return torch.log_softmax(logits, dim=-1)

    def note(self, got: float, want: float) -> None:
        diff = abs(got - want)
        MAX_DIFF[self.name] = max(MAX_DIFF.get(self.name, 0.0), diff)
        assert diff <= TOLERANCE, f"{got} vs fp64 {want} (diff {diff:.3g})"

    def check_value(self, row: torch.Tensor, token_id: int, got: float) -> None:
        want = float(row[token_id])
        if not math.isfinite(want):
            assert got == -9999.0
            return
        self.note(got, want)

    def check_natural(self, row: torch.Tensor, got: Sequence[tuple[int, float]], k: int) -> None:
        """``got``: the natural alternatives in returned order."""
        assert len(got) == min(k, row.numel())
        for token_id, value in got:
            self.check_value(row, token_id, value)
        values = [v for _, v in got]
        assert values == sorted(values, reverse=True)
        for (a, va), (b, vb) in itertools.pairwise(got):
            assert va > vb or a < b, "ties go to the lower token id"
        expected = true_top(row, k)
        for (token_id, _), want in zip(got, expected, strict=True):
            if token_id != want:  # only an fp64 near-tie may swap places
                assert abs(float(row[token_id]) - float(row[want])) <= TOLERANCE, (got, expected)

    def check_natural_set(self, row: torch.Tensor, got: set[int], chosen: int, k: int) -> None:
        """A Completions map: the chosen token plus the natural top-k (order not observable)."""
        expected = set(true_top(row, k)) | {chosen}
        kth = float(row[true_top(row, k)[-1]]) if k else math.inf
        for token_id in got ^ expected:
            assert abs(float(row[token_id]) - kth) <= TOLERANCE, (sorted(got), sorted(expected))

    def check_rank(self, row: torch.Tensor, token_id: int, rank: int) -> None:
        value = float(row[token_id])
        low = 1 + int((row > value + TOLERANCE).sum())
        high = 1 + int((row > value - TOLERANCE).sum())
        assert low <= rank <= high, (rank, low, high)


def true_top(row: torch.Tensor, k: int) -> list[int]:
    """The k largest entries by decreasing value, then increasing id."""
    values, _ = row.topk(min(k + 8, row.numel()))
    if k == 0:
        return []
    cut = float(values[min(k, values.numel()) - 1])
    candidates = torch.nonzero(row >= cut).flatten().tolist()
    return sorted(candidates, key=lambda t: (-float(row[t]), t))[:k]


def natural_of(entry: dict[str, Any], actual: int, k: int) -> list[tuple[int, float]]:
    """The natural alternatives of a prompt_logprobs entry (the actual token first, then the top k)."""
    items = [(int(t), e["logprob"]) for t, e in entry.items()]
    assert items[0][0] == actual
    if len(items) > k:
        return items[1:]  # the actual token is outside the alternatives, which keep their order
    return sorted(items, key=lambda item: (-item[1], item[0]))  # it is among them; its place is not kept


def ids_of(tokens: Sequence[str]) -> list[int]:
    out = []
    for t in tokens:
        assert t.startswith("token_id:"), t
        out.append(int(t.removeprefix("token_id:")))
    return out


def post(server: LiveServer, path: str, body: dict[str, Any]) -> dict[str, Any]:
    with server.http() as client:
        r = client.post(path, json=body)
    assert r.status_code == 200, r.text
    result: dict[str, Any] = r.json()
    return result


# -- the references ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def default_reference() -> Reference:
    if EXTERNAL:
        pytest.skip("the fp64 reference needs the default model on the local server")
    transformers = pytest.importorskip("transformers")
    from helios.loaders.default_model import ensure_default_model

    path = ensure_default_model(quiet=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float64, attn_implementation="eager",
        quantization_config=transformers.GgufConfig(dequantize=True),
    ).eval()
    return Reference(model, "default GGUF")


@pytest.fixture(scope="module")
def default_tokenizer() -> Any:
    transformers = pytest.importorskip("transformers")
    from helios.loaders.default_model import ensure_default_model

    path = ensure_default_model(quiet=True)
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


TINY_TOML = """
[server]
aliases = ["tiny"]
[model]
path = "@TINY@"
dtype = "float32"
max_model_len = 512
[engine]
max_active = 4
kv_memory_gib = 0.05
prefill_chunk_size = 7
"""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory, default_tokenizer: Any) -> Iterator[tuple[LiveServer, Reference]]:
    """A random 2-layer Llama with SmolLM2's tokenizer, served in float32, and its fp64 reference."""
    if EXTERNAL:
        pytest.skip("needs a locally started server")
    transformers = pytest.importorskip("transformers")
    tmp = tmp_path_factory.mktemp("tiny")
    directory = tmp / "tiny-llama"
    torch.manual_seed(1234)
    config = transformers.LlamaConfig(
        vocab_size=len(default_tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True,
        initializer_range=0.3, rms_norm_eps=1e-5,
        bos_token_id=default_tokenizer.bos_token_id, eos_token_id=default_tokenizer.eos_token_id,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(directory, safe_serialization=True)
    default_tokenizer.save_pretrained(directory)
    assert (directory / "tokenizer.json").is_file()
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float64, attn_implementation="eager").eval()
    server = start_server(tmp, TINY_TOML.replace("@TINY@", str(directory)), "tiny")
    yield server, Reference(reference, "tiny random Llama (fp32 server)")
    stop_server(server)


@pytest.fixture(scope="module", autouse=True)
def report() -> Iterator[None]:
    yield
    for name, diff in MAX_DIFF.items():
        print(f"\nmax |logprob - fp64| for {name}: {diff:.3g}")


# -- Completions: echo + prompt_logprobs + generation ----------------------------------------------


def check_completion(server: LiveServer, ref: Reference, prompt: str | list[int], *, k: int, prompt_k: int,
                     max_tokens: int) -> dict[str, Any]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "logprobs": k, "echo": True, "prompt_logprobs": prompt_k,
            "return_tokens_as_token_ids": True, "seed": 7, "ignore_eos": True}
    result = post(server, "/v1/completions", body)
    choice = result["choices"][0]
    lp = choice["logprobs"]
    ids = ids_of(lp["tokens"])
    num_prompt = result["usage"]["prompt_tokens"]
    assert len(ids) == num_prompt + result["usage"]["completion_tokens"]
    rows = ref(ids)
    # Echoed prompt entries.
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    scores = choice["prompt_logprobs"]
    assert scores[0] is None and len(scores) == num_prompt
    for p in range(1, len(ids)):
        row, token = rows[p - 1], ids[p]
        ref.check_value(row, token, lp["token_logprobs"][p])
        top = lp["top_logprobs"][p]
        assert next(iter(top)) == f"token_id:{token}"  # the chosen token comes first
        assert top[f"token_id:{token}"] == lp["token_logprobs"][p]
        for key, value in top.items():
            ref.check_value(row, int(key.removeprefix("token_id:")), value)
        ref.check_natural_set(row, {int(key.removeprefix("token_id:")) for key in top}, token, k)
        if p < num_prompt:
            entry = scores[p]
            assert next(iter(entry)) == str(token)
            assert entry[str(token)]["logprob"] == lp["token_logprobs"][p]
            ref.check_rank(row, token, entry[str(token)]["rank"])
            ref.check_natural(row, natural_of(entry, token, prompt_k), prompt_k)
            for t, e in entry.items():
                ref.check_rank(row, int(t), e["rank"])
                assert isinstance(e["decoded_token"], str) and not e["decoded_token"].startswith("token_id:")
    return result


def test_completions_echo_and_prompt_scores_match_fp64(server: LiveServer, default_reference: Reference) -> None:
    result = check_completion(server, default_reference, LONG_TEXT, k=5, prompt_k=3, max_tokens=6)
    assert result["usage"]["prompt_tokens"] > 256  # crossed a prefill chunk


def test_tiny_model_completions_match_fp64(tiny: tuple[LiveServer, Reference]) -> None:
    server, ref = tiny
    check_completion(server, ref, "Once upon a time, in a land far away, there lived a small dragon who", k=20,
                     prompt_k=20, max_tokens=10)
    check_completion(server, ref, [1, 2, 3, 4, 5, 900, 901, 17, 17, 17, 17, 44], k=0, prompt_k=0, max_tokens=3)


def test_tiny_model_zero_output_scoring(tiny: tuple[LiveServer, Reference]) -> None:
    server, ref = tiny
    text = "Scoring only: the prompt is submitted and nothing is generated."
    result = post(server, "/v1/completions", {"prompt": text, "max_tokens": 0, "prompt_logprobs": 4})
    choice = result["choices"][0]
    assert choice["finish_reason"] == "length" and choice["text"] == "" and choice["logprobs"] is None
    assert result["usage"]["completion_tokens"] == 0
    scores = choice["prompt_logprobs"]
    ids = [int(next(iter(e))) for e in scores[1:]]
    assert len(scores) == result["usage"]["prompt_tokens"]
    full = post(server, "/v1/completions", {"prompt": text, "max_tokens": 0, "echo": True, "logprobs": 1,
                                            "return_tokens_as_token_ids": True})
    all_ids = ids_of(full["choices"][0]["logprobs"]["tokens"])
    assert all_ids[1:] == ids
    assert full["choices"][0]["text"] == text and full["choices"][0]["finish_reason"] == "length"
    rows = ref(all_ids)
    for p, entry in enumerate(scores[1:], start=1):
        for t, e in entry.items():
            ref.check_value(rows[p - 1], int(t), e["logprob"])
            ref.check_rank(rows[p - 1], int(t), e["rank"])


# -- Chat and Responses ------------------------------------------------------------------------------


def test_chat_generation_and_prompt_scores_match_fp64(server: LiveServer, default_reference: Reference,
                                                      default_tokenizer: Any) -> None:
    messages = [{"role": "user", "content": "Name three rivers in Europe and say one thing about each."}]
    body = {"messages": messages, "max_tokens": 12, "logprobs": True, "top_logprobs": 20, "prompt_logprobs": 20,
            "return_tokens_as_token_ids": True, "seed": 3}
    result = post(server, "/v1/chat/completions", body)
    prompt_ids = list(default_tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"])
    scores = result["prompt_logprobs"]
    assert scores[0] is None and [int(next(iter(e))) for e in scores[1:]] == prompt_ids[1:]
    content = result["choices"][0]["logprobs"]["content"]
    generated = ids_of([e["token"] for e in content])
    rows = default_reference(prompt_ids + generated)
    for p in range(1, len(prompt_ids)):
        entry = scores[p]
        actual = prompt_ids[p]
        default_reference.check_natural(rows[p - 1], natural_of(entry, actual, 20), 20)
        default_reference.check_value(rows[p - 1], actual, entry[str(actual)]["logprob"])
        for t, e in entry.items():
            default_reference.check_rank(rows[p - 1], int(t), e["rank"])
    for i, entry in enumerate(content):
        row = rows[len(prompt_ids) - 1 + i]
        default_reference.check_value(row, generated[i], entry["logprob"])
        natural = [(int(e["token"].removeprefix("token_id:")), e["logprob"]) for e in entry["top_logprobs"]]
        default_reference.check_natural(row, natural, 20)


def test_explicit_ids_match_fp64(server: LiveServer, default_reference: Reference, default_tokenizer: Any) -> None:
    messages = [{"role": "user", "content": "Answer yes or no: is water wet?"}]
    explicit = [10, 5, 4093, 10, 2, 49151, 5]
    body = {"messages": messages, "max_tokens": 3, "logprobs": True, "top_logprobs": 2,
            "logprob_token_ids": explicit, "return_tokens_as_token_ids": True}
    content = post(server, "/v1/chat/completions", body)["choices"][0]["logprobs"]["content"]
    prompt_ids = list(default_tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"])
    generated = ids_of([e["token"] for e in content])
    rows = default_reference(prompt_ids + generated)
    for i, entry in enumerate(content):
        ids = ids_of([e["token"] for e in entry["top_logprobs"]])
        want = list(dict.fromkeys(explicit))
        if generated[i] not in want:
            want.append(generated[i])
        assert ids == want  # caller order, first occurrence, the sampled token appended when absent
        for e, t in zip(entry["top_logprobs"], ids, strict=True):
            default_reference.check_value(rows[len(prompt_ids) - 1 + i], t, e["logprob"])


def test_responses_output_text_logprobs_match_fp64(server: LiveServer, default_reference: Reference,
                                                  default_tokenizer: Any) -> None:
    text = "Write one short sentence about the sea."
    body = {"input": text, "max_output_tokens": 10, "include": ["message.output_text.logprobs"],
            "top_logprobs": 5, "return_tokens_as_token_ids": True}
    result = post(server, "/v1/responses", body)
    entries = [e for item in result["output"] if item["type"] == "message"
               for part in item["content"] for e in part["logprobs"]]
    prompt_ids = list(default_tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                            add_generation_prompt=True)["input_ids"])
    assert result["usage"]["input_tokens"] == len(prompt_ids)
    generated = ids_of([e["token"] for e in entries])
    rows = default_reference(prompt_ids + generated)
    for i, entry in enumerate(entries):
        row = rows[len(prompt_ids) - 1 + i]
        default_reference.check_value(row, generated[i], entry["logprob"])
        natural = [(int(e["token"].removeprefix("token_id:")), e["logprob"]) for e in entry["top_logprobs"]]
        default_reference.check_natural(row, natural, 5)


# -- shapes and rules that need no reference ---------------------------------------------------------


def test_min_tokens_takes_the_best_token_that_is_no_stop_against_fp64(server: LiveServer,
                                                                      default_reference: Reference,
                                                                      default_tokenizer: Any) -> None:
    """vLLM's min_tokens on the default model: where the greedy answer ends (fp64 ranks an EOS
    first), the request with min_tokens goes on with the fp64-best token that is no EOS, every
    token up to min_tokens is that, and its logprobs stay the raw ones; a min_tokens above
    max_tokens is a 400."""
    from helios.loaders.default_model import ensure_default_model
    from helios.loaders.gguf_loader import GGUFFile
    from helios.loaders.tokenizer import Tokenizer

    eos = set(Tokenizer.from_gguf_metadata(GGUFFile(ensure_default_model(quiet=True)).metadata).eos_token_ids)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    body = {"messages": messages, "temperature": 0, "logprobs": True, "top_logprobs": 2,
            "return_tokens_as_token_ids": True}
    plain = post(server, "/v1/chat/completions", {**body, "max_tokens": 40})
    assert plain["choices"][0]["finish_reason"] == "stop"
    n = plain["usage"]["completion_tokens"]  # its last token the EOS (which has no logprob entry)
    plain_ids = ids_of([e["token"] for e in plain["choices"][0]["logprobs"]["content"]])
    assert len(plain_ids) == n - 1
    want = n + 6
    masked = post(server, "/v1/chat/completions", {**body, "max_tokens": want, "min_tokens": want})
    choice = masked["choices"][0]
    assert choice["finish_reason"] == "length" and masked["usage"]["completion_tokens"] == want
    content = choice["logprobs"]["content"]
    ids = ids_of([e["token"] for e in content])
    assert len(ids) == want and ids[: n - 1] == plain_ids
    prompt_ids = list(default_tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"])
    rows = default_reference(prompt_ids + ids)
    allowed = torch.ones(rows.shape[1], dtype=torch.bool)
    allowed[sorted(eos)] = False
    for i, entry in enumerate(content):
        row = rows[len(prompt_ids) - 1 + i]
        assert ids[i] not in eos
        assert float(row[ids[i]]) >= float(row[allowed].max()) - TOLERANCE  # greedy among the non-stops
        default_reference.check_value(row, ids[i], entry["logprob"])  # raw: the mask comes after
    assert int(rows[len(prompt_ids) + n - 2].argmax()) in eos  # where the plain answer ended
    with server.http() as client:
        r = client.post("/v1/chat/completions", json={**body, "max_tokens": 4, "min_tokens": 5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens", r.text
    # The same field on Responses and on a streamed Completions request through the OpenAI SDK.
    response = post(server, "/v1/responses", {"input": messages, "temperature": 0, "max_output_tokens": want,
                                              "min_tokens": want})
    assert response["status"] == "incomplete" and response["usage"]["output_tokens"] == want
    chunks = list(server.openai().completions.create(
        model="m", prompt="The capital of France is Paris.", max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"min_tokens": 12}))
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 12
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_completion_text_offsets(server: LiveServer) -> None:
    prompt = "Emoji: 😀🎉 and 日本語."
    body = {"prompt": prompt, "max_tokens": 8, "logprobs": 1, "echo": True, "seed": 1, "ignore_eos": True}
    result = post(server, "/v1/completions", body)
    choice = result["choices"][0]
    offsets = choice["logprobs"]["text_offset"]
    num_prompt = result["usage"]["prompt_tokens"]
    assert len(offsets) == num_prompt + 8
    tokens = choice["logprobs"]["tokens"]
    assert offsets[:num_prompt] == [sum(len(t) for t in tokens[:i]) for i in range(num_prompt)]
    generated = offsets[num_prompt:]
    assert generated[0] == len(prompt)  # generated offsets start after the echoed text
    assert generated == sorted(generated) and generated[-1] <= len(choice["text"])


def test_chat_bytes_are_exact(server: LiveServer) -> None:
    body = {"messages": [{"role": "user", "content": "Reply with three emoji."}], "max_tokens": 16,
            "logprobs": True, "top_logprobs": 3, "seed": 11}
    result = post(server, "/v1/chat/completions", body)
    content = result["choices"][0]["logprobs"]["content"]
    joined = b"".join(bytes(e["bytes"]) for e in content)
    assert joined.decode("utf-8", errors="replace").startswith(result["choices"][0]["message"]["content"] or "")
    for e in content:
        assert e["token"] == bytes(e["bytes"]).decode("utf-8", errors="replace")
        assert len(e["top_logprobs"]) == 3


def test_streamed_entries_concatenate_to_buffered(server: LiveServer) -> None:
    body = {"messages": [{"role": "user", "content": "Count from one to five."}], "max_tokens": 12,
            "logprobs": True, "top_logprobs": 2, "seed": 5}
    buffered = post(server, "/v1/chat/completions", body)["choices"][0]["logprobs"]["content"]
    streamed: list[dict[str, Any]] = []
    with server.http() as client, client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                for c in chunk["choices"]:
                    if c.get("logprobs"):
                        streamed.extend(c["logprobs"]["content"])
    assert [e["token"] for e in streamed] == [e["token"] for e in buffered]
    # Two generations of one request: with speculation (the default) the second drafts from the
    # first's output, and a verification step sums its rows in other tiles than a one-row decode,
    # so the float32 logprobs agree to rounding, not bit for bit (as under other batch mixes).
    # (1.5e-5 measured on this float32 server; test_speculative_server allows 1e-4 too).
    assert all(abs(a["logprob"] - b["logprob"]) <= 1e-4 for a, b in zip(streamed, buffered, strict=True))


def test_streaming_echo_frames(tiny: tuple[LiveServer, Reference]) -> None:
    server, _ = tiny
    prompt = "A prompt long enough to need several prefill chunks of seven tokens each, and then some."
    body = {"prompt": prompt, "max_tokens": 3, "logprobs": 2, "echo": True, "seed": 2, "ignore_eos": True}
    buffered = post(server, "/v1/completions", body)["choices"][0]
    frames = []
    with server.http() as client, client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                frames.append(json.loads(line[6:])["choices"][0])
    text = "".join(f["text"] for f in frames)
    assert text == buffered["text"]
    merged: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for f in frames:
        for key in merged:
            merged[key].extend((f["logprobs"] or {}).get(key, []))
    assert merged == buffered["logprobs"]
    # One frame per 7-token prefill chunk, the first with the echoed text, then the generated entries.
    num_prompt = len(merged["tokens"]) - 3
    assert num_prompt > 14
    sizes = [len(f["logprobs"]["tokens"]) for f in frames if f["logprobs"]]
    num_chunks = -(-num_prompt // 7)
    assert sizes[:num_chunks] == [8] + [7] * (num_chunks - 2) + [num_prompt - 1 - 7 * (num_chunks - 1)]
    assert frames[0]["text"] == prompt and frames[0]["logprobs"]["token_logprobs"][0] is None
    assert all(f["text"] == "" for f in frames[1:num_chunks])


def test_prompt_logprobs_rules(server: LiveServer) -> None:
    cases = [
        ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 0, "stream": True}),
        ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 21}),
        ("/v1/completions", {"prompt": "hi", "prompt_logprobs": -1}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 0,
                                  "stream": True}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 1,
                                  "max_tokens": 0}),
        ("/v1/responses", {"input": "hi", "prompt_logprobs": 1}),
        ("/v1/completions", {"prompt": "hi", "logprob_token_ids": [1]}),
        ("/v1/completions", {"prompt": "hi", "logprobs": 1, "logprob_token_ids": list(range(129))}),
        ("/v1/completions", {"prompt": "hi", "logprobs": 1, "logprob_token_ids": [49152]}),
        ("/v1/completions", {"prompt": "hi", "logprobs": 1, "logprob_token_ids": [-1]}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                                  "top_logprobs": 21}),
    ]
    with server.http() as client:
        for path, body in cases:
            r = client.post(path, json=body)
            assert r.status_code == 400, (path, body, r.text)
            assert r.json()["error"]["type"] == "invalid_request_error"
        r = client.post("/v1/messages", json={"model": "m", "max_tokens": 4, "logprobs": True,
                                              "messages": [{"role": "user", "content": "hi"}]},
                        headers={"anthropic-version": "2023-06-01"})
        assert r.status_code == 400 and r.json()["type"] == "error"
        # Accepted shapes: 128 ids before deduplication, null and empty arrays as omission, top 0 alone.
        ok = [
            ("/v1/completions", {"prompt": "hi", "max_tokens": 1, "logprobs": 1,
                                 "logprob_token_ids": list(range(100)) + list(range(28))}),
            ("/v1/completions", {"prompt": "hi", "max_tokens": 1, "logprob_token_ids": None}),
            ("/v1/completions", {"prompt": "hi", "max_tokens": 1, "logprob_token_ids": []}),
            ("/v1/completions", {"prompt": "hi", "max_tokens": 0, "echo": True, "logprobs": 2,
                                 "logprob_token_ids": [5, 6]}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                                      "top_logprobs": 0}),
        ]
        for path, body in ok:
            r = client.post(path, json=body)
            assert r.status_code == 200, (path, body, r.text)
    explicit = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 1, "logprobs": 0,
                                                 "logprob_token_ids": list(range(128)),
                                                 "return_tokens_as_token_ids": True})
    top = explicit["choices"][0]["logprobs"]["top_logprobs"][0]
    assert 128 <= len(top) <= 129  # numeric top-k never truncates explicit results
    zero = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 0, "echo": True, "logprobs": 2,
                                             "logprob_token_ids": [5, 6]})
    assert zero["usage"]["completion_tokens"] == 0 and zero["choices"][0]["finish_reason"] == "length"


def test_buffered_echo_n_shares_prompt_scores(server: LiveServer) -> None:
    body = {"prompt": ["First prompt here.", "Second one."], "n": 2, "max_tokens": 2, "logprobs": 1, "echo": True,
            "prompt_logprobs": 2, "seed": 9}
    result = post(server, "/v1/completions", body)
    choices = result["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    assert choices[0]["prompt_logprobs"] == choices[1]["prompt_logprobs"]
    assert choices[2]["prompt_logprobs"] == choices[3]["prompt_logprobs"]
    assert choices[0]["prompt_logprobs"] != choices[2]["prompt_logprobs"]
    for c in choices:
        assert all(len(e) <= 3 for e in c["prompt_logprobs"][1:])


# -- a server without logprob outputs or prompt scores ----------------------------------------------


DISABLED_TOML = """
[server]
max_top_logprobs = 0
prompt_logprobs = false
[model]
path = "@MODEL@"
dtype = "float32"
max_model_len = 512
[engine]
max_active = 2
kv_memory_gib = 0.05
"""


@pytest.fixture(scope="module")
def disabled(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    if EXTERNAL:
        pytest.skip("needs a specially configured local server")
    s = start_server(tmp_path_factory.mktemp("nolp"), DISABLED_TOML, "nolp")
    yield s
    stop_server(s)


def test_server_without_logprob_outputs(disabled: LiveServer) -> None:
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    rejected = [
        ("/v1/chat/completions", {**chat, "logprobs": True}),
        ("/v1/chat/completions", {**chat, "logprobs": True, "top_logprobs": 1}),
        ("/v1/chat/completions", {**chat, "prompt_logprobs": 0}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 1, "logprobs": 0}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 1, "prompt_logprobs": 1}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 0, "prompt_logprobs": 1}),
        ("/v1/responses", {"input": "hi", "include": ["message.output_text.logprobs"]}),
    ]
    with disabled.http() as client:
        for path, body in rejected:
            r = client.post(path, json=body)
            assert r.status_code == 400, (path, body, r.text)
            assert r.json()["error"]["type"] == "invalid_request_error"
        r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, "prompt_logprobs": 1})
        assert "re-export" in r.json()["error"]["message"]
        # Decisions read explicit-ID logprobs, which this core lacks.
        for path, body in [
            ("/v1/systemone", {"model": "m", "state": "s", "questions": {"a": {"type": "noul", "instructions": "x"}}}),
            ("/v1/decisions", {"model": "m", "input": "s", "questions": [{"type": "predicate", "instructions": "x"}]}),
        ]:
            r = client.post(path, json=body)
            assert r.status_code == 400 and "re-export" in r.json()["error"]["message"], r.text
        for path, body in [("/v1/chat/completions", {**chat, "top_logprobs": 0}),
                           ("/v1/completions", {"prompt": "hi", "max_tokens": 1}),
                           ("/v1/completions", {"prompt": "hi", "max_tokens": 0, "echo": True})]:
            assert client.post(path, json=body).status_code == 200
        card = client.get("/v1/models").json()["data"][0]
        assert card["permission"][0]["allow_logprobs"] is False and card["flare"]["max_top_logprobs"] == 0


# -- the OpenAI SDK parses every shape ---------------------------------------------------------------


def test_sdk_parses_logprob_shapes(server: LiveServer) -> None:
    client = server.openai()
    messages = [{"role": "user", "content": "Say hello."}]
    chat = client.chat.completions.create(model="m", messages=messages, max_tokens=4, logprobs=True,  # type: ignore[arg-type]
                                          top_logprobs=3, extra_body={"prompt_logprobs": 2})
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content and all(len(e.top_logprobs) == 3 and isinstance(e.bytes, list) for e in content)
    assert (chat.model_extra or {})["prompt_logprobs"][0] is None
    stream = client.chat.completions.create(model="m", messages=messages, max_tokens=4, logprobs=True,  # type: ignore[arg-type]
                                            top_logprobs=1, stream=True)
    streamed = [e for chunk in stream for c in chunk.choices if c.logprobs and c.logprobs.content
                for e in c.logprobs.content]
    assert streamed and all(e.top_logprobs for e in streamed)
    completion = client.completions.create(model="m", prompt="Hello", max_tokens=3, logprobs=2, echo=True,
                                           extra_body={"prompt_logprobs": 1})
    lp = completion.choices[0].logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs and lp.text_offset
    assert lp.token_logprobs[0] is None
    assert (completion.choices[0].model_extra or {})["prompt_logprobs"][0] is None
    chunks = list(client.completions.create(model="m", prompt="Hello", max_tokens=3, logprobs=2, echo=True,
                                            stream=True))
    assert any(c.choices and c.choices[0].logprobs and c.choices[0].logprobs.tokens for c in chunks)
    response = client.responses.create(model="m", input="Say hello.", max_output_tokens=5, top_logprobs=2,
                                       include=["message.output_text.logprobs"])
    parts = [p for item in response.output if item.type == "message" for p in item.content]
    assert parts and all(p.type == "output_text" and p.logprobs is not None for p in parts)
    events = list(client.responses.create(model="m", input="Say hello.", max_output_tokens=5, top_logprobs=2,
                                          include=["message.output_text.logprobs"], stream=True))
    assert any(e.type == "response.output_text.delta" and e.logprobs for e in events)


def test_http_errors_are_protocol_shaped(server: LiveServer) -> None:
    with httpx.Client(base_url=server.url, timeout=60) as client:
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                      "logprobs": "yes"})
    assert r.status_code in (400, 401)
    assert set(r.json()["error"]) == {"type", "message", "param", "code"}


def test_logit_bias_changes_the_choice_not_the_logprobs(server: LiveServer) -> None:
    """vLLM applies logit_bias after the logprobs are taken: the reported distribution stays raw."""
    body: dict[str, Any] = {"model": "m", "prompt": "The capital of France is", "max_tokens": 1,
                            "temperature": 0, "logprobs": 5, "return_tokens_as_token_ids": True}
    plain = post(server, "/v1/completions", body)["choices"][0]["logprobs"]
    first = int(plain["tokens"][0].split(":")[1])
    second = sorted(plain["top_logprobs"][0].items(), key=lambda kv: -kv[1])[1][0]
    second_id = int(second.split(":")[1])
    biased = post(server, "/v1/completions", {**body, "logit_bias": {str(first): -100}})["choices"][0]["logprobs"]
    assert int(biased["tokens"][0].split(":")[1]) == second_id  # the argmax was banned
    assert biased["top_logprobs"][0] == plain["top_logprobs"][0]  # raw alternatives, unbiased
    assert biased["token_logprobs"][0] == plain["top_logprobs"][0][second]
    with server.http() as client:
        r = client.post("/v1/chat/completions", json={
            "model": "m", "max_tokens": 1, "temperature": 0, "logit_bias": {"9999999": 1},
            "messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias"
