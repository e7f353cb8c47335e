"""SDK conformance: the real OpenAI SDK against a live hypercorn process serving the default model.

Run against any server with FLARE_API_TEST_URL=http://127.0.0.1:8000 (and FLARE_API_TEST_KEY).
"""

from __future__ import annotations

import gzip
import json
import time
import zlib

import brotli
import httpx
import openai
import pytest
import zstandard

from tests.server.conftest import EXTERNAL as EXTERNAL_URL
from tests.server.conftest import LiveServer, provoke_admission_failures

pytestmark = pytest.mark.slow

CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]


def model_name(server: LiveServer) -> str:
    return server.openai().models.list().data[0].id


# -- models -----------------------------------------------------------------------------------


def test_models_list_and_card(server: LiveServer) -> None:
    client = server.openai()
    models = client.models.list().data
    assert len(models) == 1
    card = models[0]
    extra = card.model_extra or {}
    assert extra["root"] and extra["parent"] is None and card.owned_by == "local"
    flare = extra["flare"]
    assert flare["input_modalities"] == ["text"] and flare["max_top_logprobs"] <= 20
    perm = extra["permission"][0]
    assert perm["allow_sampling"] and perm["allow_view"] and not perm["allow_fine_tuning"]
    names = [extra["root"], card.id]
    if not EXTERNAL_URL:  # the local server's configuration
        assert card.id == "smol"  # first configured alias
        assert extra["max_model_len"] == 8192
        assert flare["vocab_size"] == 49152 and flare["max_top_logprobs"] == 20
        names.append("HuggingFaceTB/SmolLM2-135M-Instruct")  # an alias with a slash
    # The same card under the checkpoint id and every alias.
    for name in names:
        again = client.models.retrieve(name)
        assert again.id == card.id and again.created == card.created
        assert (again.model_extra or {})["permission"][0]["id"] == perm["id"]
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("no-such-model")
    assert err.value.body["code"] == "model_not_found"  # type: ignore[index]


# -- chat -------------------------------------------------------------------------------------


def test_greedy_default_model_answers_paris(server: LiveServer) -> None:
    r = server.openai().chat.completions.create(model="anything", messages=CAPITAL, temperature=0, max_tokens=20)
    assert r.choices[0].message.content == "The capital of France is Paris."
    assert r.choices[0].finish_reason == "stop"
    assert r.model == model_name(server)
    assert r.usage is not None and r.usage.completion_tokens == 8  # 7 text tokens + <|im_end|>
    # Other tests may have sent this prompt before: whole pages of it can be reused, never all of it.
    details = r.usage.prompt_tokens_details
    assert details is not None and details.cached_tokens is not None
    assert 0 <= details.cached_tokens < r.usage.prompt_tokens and details.cached_tokens % 16 == 0


def test_streamed_text_equals_buffered_for_a_seed(server: LiveServer) -> None:
    client = server.openai()
    kw = dict(model="m", messages=[{"role": "user", "content": "Write a short poem about the sea."}],
              temperature=0.9, seed=1234, max_tokens=40)
    buffered = client.chat.completions.create(**kw)  # type: ignore[call-overload]
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))  # type: ignore[call-overload]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == buffered.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [buffered.choices[0].finish_reason]
    usage = chunks[-1].usage
    assert usage is not None and chunks[-1].choices == []
    assert usage.completion_tokens == buffered.usage.completion_tokens  # type: ignore[union-attr]
    assert usage.prompt_tokens == buffered.usage.prompt_tokens  # type: ignore[union-attr]


def test_seed_is_reproducible_and_n_choices_differ(server: LiveServer) -> None:
    client = server.openai()
    kw = dict(model="m", messages=[{"role": "user", "content": "Name a color."}], temperature=1.0, max_tokens=12)
    a = client.chat.completions.create(seed=7, n=3, **kw)  # type: ignore[call-overload]
    b = client.chat.completions.create(seed=7, n=3, **kw)  # type: ignore[call-overload]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert [c.index for c in a.choices] == [0, 1, 2]
    # Choice i uses seed + i: choice 1 of seed 7 equals choice 0 of seed 8.
    c = client.chat.completions.create(seed=8, n=1, **kw)  # type: ignore[call-overload]
    assert c.choices[0].message.content == a.choices[1].message.content
    assert a.usage is not None and a.usage.prompt_tokens == c.usage.prompt_tokens  # type: ignore[union-attr]


def test_continuous_usage_stats(server: LiveServer) -> None:
    chunks = list(server.openai().chat.completions.create(
        model="m", messages=CAPITAL, temperature=0, max_tokens=20, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    counts = [c.usage.completion_tokens for c in chunks if c.usage is not None]
    assert len(counts) == len(chunks)
    assert counts == sorted(counts) and counts[-1] == 8


def test_chat_stop_string_and_length(server: LiveServer) -> None:
    client = server.openai()
    r = client.chat.completions.create(model="m", messages=CAPITAL, temperature=0, max_tokens=20, stop=["Paris"])
    assert r.choices[0].message.content == "The capital of France is "
    assert r.choices[0].finish_reason == "stop"
    # A stop string spanning a token boundary ("capital of" is several tokens).
    r = client.chat.completions.create(model="m", messages=CAPITAL, temperature=0, max_tokens=20, stop=["tal of"])
    assert r.choices[0].message.content == "The capi"
    r = client.chat.completions.create(model="m", messages=CAPITAL, temperature=0, max_tokens=3)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3  # type: ignore[union-attr]
    s = list(client.chat.completions.create(model="m", messages=CAPITAL, temperature=0, max_tokens=20,
                                            stop=["Paris"], stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in s) == "The capital of France is "


def test_usage_matches_tokenizer(server: LiveServer) -> None:
    from transformers import AutoTokenizer

    from helios.loaders.default_model import ensure_default_model

    gguf = ensure_default_model()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)  # independent reference
    client = server.openai()
    text = "Once upon a time, in a land far away, lived 12345 dragons 🐉."
    r = client.completions.create(model="m", prompt=text, max_tokens=5, temperature=0)
    assert r.usage is not None and r.usage.prompt_tokens == len(tok.encode(text, add_special_tokens=False))
    r2 = client.completions.create(model="m", prompt=text, max_tokens=5, temperature=0, logprobs=0)
    assert r2.usage is not None and len(r2.choices[0].logprobs.tokens) == r2.usage.completion_tokens  # type: ignore[union-attr]


# -- completions -----------------------------------------------------------------------------


def test_completions_batched_prompts_n_and_echo(server: LiveServer) -> None:
    client = server.openai()
    r = client.completions.create(model="m", prompt=["The sky is", "Two plus two is"], n=2, max_tokens=4,
                                  temperature=0.8, seed=3, echo=True)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].text.startswith("The sky is") and r.choices[1].text.startswith("The sky is")
    assert r.choices[2].text.startswith("Two plus two is")
    assert r.usage is not None and r.usage.completion_tokens == 16
    # Token-id prompts are preserved; echo decodes them.
    tok_prompt = [504, 6352, 314]
    r = client.completions.create(model="m", prompt=tok_prompt, max_tokens=2, temperature=0, echo=True)
    assert r.usage is not None and r.usage.prompt_tokens == 3
    # max_tokens 0 only tokenizes and echoes.
    r = client.completions.create(model="m", prompt="Hello there", max_tokens=0, echo=True)
    assert r.choices[0].text == "Hello there" and r.choices[0].finish_reason == "length"
    assert r.usage is not None and r.usage.completion_tokens == 0


def test_completion_stream_matches_buffered(server: LiveServer) -> None:
    client = server.openai()
    kw = dict(model="m", prompt=["Alpha beta", "One two three"], n=2, max_tokens=10, temperature=0.7, seed=11)
    buffered = client.completions.create(**kw)  # type: ignore[call-overload]
    texts = [""] * 4
    usage = None
    for c in client.completions.create(stream=True, stream_options={"include_usage": True}, **kw):  # type: ignore[call-overload]
        for ch in c.choices:
            texts[ch.index] += ch.text
        usage = c.usage or usage
    assert texts == [c.text for c in buffered.choices]
    assert usage is not None and usage.completion_tokens == buffered.usage.completion_tokens  # type: ignore[union-attr]


def test_completion_rejections(server: LiveServer) -> None:
    client = server.openai()
    for kw in (dict(suffix="x"), dict(best_of=3, n=1), dict(prompt=[]), dict(prompt=[[]]),
               dict(prompt=[10**9]), dict(stop=["a", "b", "c", "d", "e"]), dict(stop=[""])):
        args = dict(model="m", prompt="Hi", max_tokens=2) | kw
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(**args)  # type: ignore[call-overload]
        assert err.value.body["type"] == "invalid_request_error"  # type: ignore[index]


# -- errors ------------------------------------------------------------------------------------


def test_request_errors_have_openai_shape(server: LiveServer) -> None:
    client = server.openai()
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="m", messages=CAPITAL, extra_body={"bogus_field": 1})
    assert "bogus_field" in err.value.message
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="m", messages=CAPITAL, max_tokens="ten")  # type: ignore[arg-type]
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="m", messages=CAPITAL, temperature=True)  # type: ignore[arg-type]
    # An output limit beyond the context is cut to the room left (the default clamp; the `limited`
    # server checks vLLM's 400 under "reject").
    cut = client.chat.completions.create(model="m", messages=CAPITAL, max_tokens=100_000, temperature=0, stop=["."])
    assert cut.choices[0].finish_reason == "stop" and "Paris" in (cut.choices[0].message.content or "")
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "word " * 9000}], max_tokens=5)
    assert "context length" in err.value.message
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="m", messages=[])
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="m", messages=CAPITAL, top_logprobs=3)
    with pytest.raises(openai.BadRequestError) as err:  # numeric effort is DeepSeek V4.1's alone
        client.chat.completions.create(model="m", messages=CAPITAL, extra_body={"reasoning_effort": 80})
    assert err.value.body["param"] == "reasoning_effort"  # type: ignore[index]
    ok = client.chat.completions.create(model="m", messages=CAPITAL, reasoning_effort="high", max_tokens=2)
    assert ok.choices[0].finish_reason == "length"
    with httpx.Client(base_url=server.url) as h:
        r = h.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
        assert set(r.json()["error"]) == {"type", "message", "param", "code"}
        r = h.get("/v1/nothing-here")
        assert r.status_code == 404 and "error" in r.json()
        r = h.post("/v1/chat/completions", content=b"{}", headers={"content-encoding": "compress"})
        assert r.status_code == 415


def test_content_encodings(server: LiveServer) -> None:
    body = json.dumps({"model": "m", "messages": CAPITAL, "max_tokens": 3, "temperature": 0}).encode()
    encoders = {
        "gzip": gzip.compress,
        "deflate": zlib.compress,
        "br": brotli.compress,
        "zstd": zstandard.ZstdCompressor().compress,
    }
    with httpx.Client(base_url=server.url, timeout=60) as h:
        for name, enc in encoders.items():
            r = h.post("/v1/chat/completions", content=enc(body),
                       headers={"content-encoding": name, "content-type": "application/json"})
            assert r.status_code == 200, (name, r.text)
            assert r.json()["choices"][0]["message"]["content"] == "The capital of"
            assert r.headers["x-request-id"]


def test_health_and_metrics(server: LiveServer) -> None:
    with httpx.Client(base_url=server.url) as h:
        assert h.get("/health").json() == {"status": "ok"}
        text = h.get("/metrics").text
        assert "flare_generated_tokens_total" in text and "flare_free_kv_pages" in text
        snap = h.get("/metrics", params={"format": "json"}).json()
        assert snap["total_pages"] > 0 and snap["page_tokens"] == 16
        assert h.get("/metrics", headers={"accept": "application/json"}).json()["total_pages"] == snap["total_pages"]
        assert h.get("/metrics", params={"format": "xml"}).status_code == 400


def test_disconnect_mid_stream_aborts_and_frees_pages(server: LiveServer) -> None:
    with httpx.Client(base_url=server.url, timeout=60) as h:
        before = h.get("/metrics", params={"format": "json"}).json()
        body = {"model": "m", "prompt": "Count forever:", "max_tokens": 2000, "ignore_eos": True, "stream": True}
        with h.stream("POST", "/v1/completions", json=body) as r:
            n = 0
            for line in r.iter_lines():
                if line.startswith("data:"):
                    n += 1
                if n >= 5:
                    break
        # The engine child is aborted and its pages are back within a few steps.
        deadline = time.time() + 10
        while time.time() < deadline:
            snap = h.get("/metrics", params={"format": "json"}).json()
            if snap["active"] == 0 and snap["free_pages"] == before["free_pages"]:
                break
            time.sleep(0.05)
        assert snap["active"] == 0 and snap["free_pages"] == snap["total_pages"]
        assert snap["generated_tokens"] - before["generated_tokens"] < 500


# -- auth, limits, admission -------------------------------------------------------------------


def test_auth_required(limited: LiveServer) -> None:
    import openai as oa

    bad = oa.OpenAI(base_url=limited.v1, api_key="wrong", max_retries=0)
    with pytest.raises(oa.AuthenticationError) as err:
        bad.models.list()
    assert err.value.body["type"] == "authentication_error"  # type: ignore[index]
    assert limited.openai().models.list().data
    with httpx.Client(base_url=limited.url) as h:
        assert h.get("/health").status_code == 200  # unauthenticated
        assert h.post("/v1/chat/completions", json={}).status_code == 401


def test_body_limits(limited: LiveServer) -> None:
    with limited.http() as h:
        big = json.dumps({"model": "m", "prompt": "x" * 70000}).encode()
        assert h.post("/v1/completions", content=big).status_code == 413
        bomb = gzip.compress(b'{"prompt": "' + b"a" * 5_000_000 + b'"}')
        r = h.post("/v1/completions", content=bomb, headers={"content-encoding": "gzip"})
        assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"
        over = {"model": "m", "prompt": "hello " * 600, "max_tokens": 4}
        r = h.post("/v1/completions", json=over)
        assert r.status_code == 400 and "context length" in r.json()["error"]["message"]


def test_admission_429_and_queue_503(limited: LiveServer) -> None:
    client = limited.openai()
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="m", prompt="Hi", n=4, max_tokens=2)  # more choices than slots
    provoke_admission_failures(limited)
    assert client.completions.create(model="m", prompt="Hi", max_tokens=2).choices


def test_token_stops_and_ignore_eos(server: LiveServer) -> None:
    client = server.openai()
    base = client.completions.create(model="m", prompt="The capital of France is", max_tokens=6, temperature=0,
                                     logprobs=0)
    ids = [int(t.split(":")[1]) for t in client.completions.create(
        model="m", prompt="The capital of France is", max_tokens=6, temperature=0, logprobs=0,
        extra_body={"return_tokens_as_token_ids": True}).choices[0].logprobs.tokens]  # type: ignore[union-attr]
    assert len(ids) == 6
    # Stop on the third generated token: its text is not returned and the reason is "stop".
    r = client.completions.create(model="m", prompt="The capital of France is", max_tokens=6, temperature=0,
                                  extra_body={"stop_token_ids": [ids[2]]})
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 3  # type: ignore[union-attr]
    assert base.choices[0].text.startswith(r.choices[0].text)
    assert (r.choices[0].model_extra or {}).get("stop_reason") == ids[2]
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="m", prompt="x", max_tokens=2, stop=["a"], extra_body={"stop_token_ids": [5]})
    # ignore_eos: the answer's <|im_end|> no longer ends the chat turn; the limit does.
    r = client.chat.completions.create(model="m", messages=CAPITAL, temperature=0, max_tokens=12,
                                       extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 12  # type: ignore[union-attr]
    assert r.choices[0].message.content.startswith("The capital of France is Paris.")  # type: ignore[union-attr]


def test_cli_serve_with_api_key_file(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """`helios serve MODEL --port P --api-key-file F` (the README's CLI path, not hypercorn's)."""
    import socket
    import subprocess
    import sys

    from helios.loaders.default_model import ensure_default_model

    if EXTERNAL_URL:
        pytest.skip("starts its own server")
    key_file = tmp_path / "key"
    key_file.write_text("cli-secret\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = tmp_path / "c.toml"
    cfg.write_text("[engine]\nkv_memory_gib = 0.1\n[server]\napi_key = \"overridden\"\n")
    proc = subprocess.Popen([sys.executable, "-m", "helios.cli", "serve", str(ensure_default_model()), "--port",
                             str(port), "--config", str(cfg), "--api-key-file", str(key_file)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 180
        while time.time() < deadline:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        client = openai.OpenAI(base_url=url + "/v1", api_key="cli-secret", max_retries=0)
        assert client.models.list().data[0].id
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="overridden", max_retries=0).models.list()
    finally:
        proc.terminate()
        out = proc.communicate(timeout=30)[0].decode()
    assert "Loaded" in out and " s" in out  # loading reports the time it took


def test_cli_rejects_a_bad_config(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import subprocess
    import sys

    cfg = tmp_path / "bad.toml"
    cfg.write_text("[server]\nport = \"eighty\"\nmystery = 1\n")
    r = subprocess.run([sys.executable, "-m", "helios.cli", "serve", "--config", str(cfg)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2
    assert "server.port" in r.stderr and "mystery" in r.stderr


def test_concurrent_requests_do_not_disturb_each_other(server: LiveServer) -> None:
    """Seeded requests give the same text alone and amid concurrent traffic, including streams that
    are cancelled half-way (their children are aborted while the others keep running)."""
    from concurrent.futures import ThreadPoolExecutor

    client = server.openai()
    prompts = [f"Tell me a fact about the number {i}." for i in range(5)]

    def one(i: int) -> str:
        r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": prompts[i]}],
                                           temperature=0.8, seed=100 + i, max_tokens=24)
        return r.choices[0].message.content or ""

    def cancelled(i: int) -> int:
        n = 0
        with httpx.Client(base_url=server.url, timeout=60) as h, h.stream(
            "POST", "/v1/completions",
            json={"model": "m", "prompt": f"Noise {i}:", "max_tokens": 200, "stream": True, "ignore_eos": True},
        ) as r:
            for line in r.iter_lines():
                n += line.startswith("data:")
                if n >= 3 + i:
                    break
        return n

    alone = [one(i) for i in range(len(prompts))]
    with ThreadPoolExecutor(max_workers=8) as pool:
        noise = [pool.submit(cancelled, i) for i in range(3)]
        together = list(pool.map(one, range(len(prompts))))
        assert all(f.result() >= 3 for f in noise)
    assert together == alone
    with httpx.Client(base_url=server.url) as h:
        deadline = time.time() + 10
        while h.get("/metrics", params={"format": "json"}).json()["active"] and time.time() < deadline:
            time.sleep(0.1)
        snap = h.get("/metrics", params={"format": "json"}).json()
        assert snap["active"] == 0 and snap["free_pages"] == snap["total_pages"]
