"""Output encode cost per protocol: one 1,000-token stream through the protocol's encoder, each
event serialized as the SSE writer serializes it, and the buffered body.

    PYTHONPATH=. .venv/bin/python scripts/bench_encode.py [--rounds 7] [--tokens 1000] [--protocol chat ...]

Each stream is one choice generating `--tokens` updates of one token each (a text delta per token;
the `+logprobs` variants ask for 5 alternatives per token). Reports per protocol the median (and
the minimum, steadier on a shared machine) over rounds of the time per token (µs): `stream` is
start + every feed + finish + the JSON text of every event; `body` is the buffered path (every
feed, then the body's JSON text). No model is loaded: the encoders read a fake vocabulary.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

from helios.asgi.responses import dumps
from helios.domain.events import Finish, FinishCause, TextDelta
from helios.domain.generation import ChildUpdate, PreparedPrompt
from helios.domain.logprobs import TokenLogprob
from helios.domain.model import ModelInfo
from helios.domain.sampling import SamplingParams
from helios.frontends.anthropic import messages, messages_encoder
from helios.frontends.openai import chat, completions, responses, responses_encoder

INFO = ModelInfo(
    model_id="org/model", aliases=("m",), created=0, max_model_len=32768, vocab_size=50_000,
    default_max_tokens=256, max_concurrency=4, prefill_chunk_size=256, max_top_logprobs=20,
    prompt_logprobs=True, sampling_defaults={}, sampling_ranges={}, recipe="qwen38", has_bos=True,
    has_reasoning=True, has_tools=True,
)
PROMPT = PreparedPrompt(tuple(range(100)), "x" * 300)


class Vocab:
    def token_bytes(self, token_id: int) -> bytes:
        return b" tok%d" % (token_id % 1000)


def updates(n: int, logprobs: bool) -> list[ChildUpdate]:
    out = []
    for k in range(n):
        lp = (TokenLogprob(k, -0.5, 1, tuple((k + j, -1.0 - j) for j in range(5))),) if logprobs else None
        out.append(ChildUpdate(events=[TextDelta(f" tok{k % 1000}")], token_ids=(k,), logprobs=lp,
                               finish=Finish(FinishCause.LENGTH) if k == n - 1 else None,
                               num_prompt_tokens=100, num_output_tokens=k + 1, num_cached_tokens=0,
                               logprob_offsets=(0,) if logprobs else ()))
    return out


def make(protocol: str) -> Callable[[], Any]:
    vocab = Vocab()
    if protocol.startswith("chat"):
        extra = {"logprobs": True, "top_logprobs": 5} if protocol.endswith("+logprobs") else {}
        plan = chat.decode_chat({"messages": [{"role": "user", "content": "hi"}], "stream": True, **extra}, INFO)
        return lambda: chat.ChatEncoder(plan, [PROMPT], model="m", vocab=vocab)
    if protocol.startswith("completions"):
        extra = {"logprobs": 5} if protocol.endswith("+logprobs") else {}
        cplan = completions.decode_completion({"prompt": "hi", "stream": True, **extra}, INFO)
        return lambda: completions.CompletionEncoder(cplan, [PROMPT], model="m", vocab=vocab)
    if protocol.startswith("responses"):
        extra = ({"include": ["message.output_text.logprobs"], "top_logprobs": 5}
                 if protocol.endswith("+logprobs") else {})
        rplan = responses.decode_responses({"input": "hi", "stream": True, **extra}, INFO)
        return lambda: responses_encoder.make_encoder(rplan, [PROMPT], SamplingParams(), model="m", vocab=vocab)
    mplan = messages.decode_request({"model": "m", "max_tokens": 4096, "stream": True,
                                     "messages": [{"role": "user", "content": "hi"}]}, INFO)
    return lambda: messages_encoder.MessagesEncoder(mplan, [PROMPT], model="m")


def text(data: Any) -> str:
    """An event's data as the SSE writer writes it (`data` read once, as `EventStream.send` does)."""
    return data if isinstance(data, str) else dumps(data)


def stream_once(new: Callable[[], Any], script: list[ChildUpdate]) -> int:
    enc = new()
    size = 0
    for e in enc.start():
        size += len(text(e.data))
    for u in script:
        for e in enc.feed(0, u):
            size += len(text(e.data))
    for e in enc.finish():
        size += len(text(e.data))
    return size


def body_once(new: Callable[[], Any], script: list[ChildUpdate]) -> int:
    enc = new()
    enc.start()
    for u in script:
        enc.feed(0, u)
    enc.finish()
    return len(dumps(enc.body()))


PROTOCOLS = ("chat", "chat+logprobs", "completions", "completions+logprobs", "responses", "responses+logprobs",
             "messages")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--protocol", nargs="*", default=list(PROTOCOLS), choices=PROTOCOLS)
    args = ap.parse_args()
    print(f"{'protocol':22} {'stream µs/token (median, min)':>30} {'body µs/token (median, min)':>30}")
    for protocol in args.protocol:
        new = make(protocol)
        script = updates(args.tokens, protocol.endswith("+logprobs"))
        row = []
        for run in (stream_once, body_once):
            run(new, script)  # warm up
            times = []
            for _ in range(args.rounds):
                t0 = time.perf_counter()
                run(new, script)
                times.append((time.perf_counter() - t0) / args.tokens * 1e6)
            row.append(f"{statistics.median(times):14.2f} {min(times):14.2f}")
        print(f"{protocol:22} {row[0]:>30} {row[1]:>30}", flush=True)


if __name__ == "__main__":
    main()
