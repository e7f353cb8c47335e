"""Connection reuse under bursts (issue 31, item 2): one pooled httpx client (the default pool
expiry, 5 s, as the OpenAI and Anthropic SDKs use) fires bursts past admission, buffered and
streamed, on Chat Completions and Messages, with idle gaps right at the pool's expiry between some
bursts, against the scripted model served with `helios serve`'s hypercorn configuration. No request
may end in a transport error: the server's idle timeout (`cli.KEEP_ALIVE_SECONDS`, 75 s) outlasts
the client's pool, so the client always drops an idle connection before the server closes it
(with hypercorn's default, 5 s, requests sent in the gaps die with ReadError / "Server
disconnected"; docs/operations.md, Transport)."""

from __future__ import annotations

import asyncio
import json
import random
from collections import Counter
from collections.abc import Iterator

import attrs
import httpx
import pytest

from tests.serving.harness import FAMILIES, TEMPLATES, ScriptedServer, serving_config

REQUESTS = 5000
WINDOW = 40  # requests in flight at once; the server admits 8 and queues 2
# Seconds idle before five phases, just under httpx's 5 s pool expiry: the pool reuses its
# connections after idle times spread over [gap, gap + the window's drain], and with hypercorn's
# default 5 s keep-alive one of these reuses met a closing connection (ReadError) in 600 requests.
GAPS = (4.7, 4.75, 4.8, 4.85, 4.9)
GAP_AT = (800, 1600, 2400, 3200, 4000)
KINDS = ("chat", "chat_stream", "messages", "messages_stream")


@pytest.fixture(scope="module")
def server() -> Iterator[ScriptedServer]:
    if TEMPLATES is None:
        pytest.skip("shared/fixtures/chat_templates not found (shared/ lies beside the repository)")
    cfg = serving_config()
    cfg = attrs.evolve(cfg, server=attrs.evolve(cfg.server, max_concurrency=8, model_queue_size=2),
                       engine=attrs.evolve(cfg.engine, max_active=4))
    srv = ScriptedServer(FAMILIES["qwen3"], config=cfg).start()
    yield srv
    srv.stop()


async def _one(client: httpx.AsyncClient, kind: str, i: int) -> str:
    """One request; its outcome: the HTTP status, or the transport error's class name."""
    stream = kind.endswith("stream")
    if kind.startswith("chat"):
        path, headers = "/v1/chat/completions", {}
        body = {"model": "scripted", "messages": [{"role": "user", "content": f"hello {i}"}], "max_tokens": 8,
                "stream": stream}
    else:
        path, headers = "/v1/messages", {"anthropic-version": "2023-06-01"}
        body = {"model": "scripted", "messages": [{"role": "user", "content": f"hello {i}"}], "max_tokens": 8,
                "stream": stream}
    try:
        if not stream:
            r = await client.post(path, json=body, headers=headers)
            if r.status_code == 200:
                json.loads(r.content)
            return str(r.status_code)
        async with client.stream("POST", path, json=body, headers=headers) as r:
            async for _ in r.aiter_bytes():
                pass
            return str(r.status_code)
    except httpx.TransportError as exc:
        return type(exc).__name__


async def _bursts(url: str) -> Counter[str]:
    """REQUESTS requests, WINDOW at a time through one pool (more than the server admits, so bursts
    of 429s and 503s), the window emptied and the pool left idle for one of GAPS before each of
    GAP_AT."""
    rng = random.Random(31)
    outcomes: Counter[str] = Counter()
    limits = httpx.Limits(max_connections=WINDOW, max_keepalive_connections=WINDOW)  # the default 5 s expiry
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:
        window = asyncio.Semaphore(WINDOW)

        async def run(i: int) -> None:
            try:
                outcomes[await _one(client, rng.choice(KINDS), i)] += 1
            finally:
                window.release()

        tasks: list[asyncio.Task[None]] = []
        for i in range(REQUESTS):
            if i in GAP_AT:
                await asyncio.gather(*tasks)
                tasks.clear()
                await asyncio.sleep(GAPS[GAP_AT.index(i)] + rng.uniform(-0.02, 0.02))
            await window.acquire()
            tasks.append(asyncio.create_task(run(i)))
        await asyncio.gather(*tasks)
    return outcomes


def test_the_server_keeps_idle_connections_longer_than_client_pools() -> None:
    """The cause, stated: the server's idle timeout exceeds the pool expiry of httpx and of the
    OpenAI and Anthropic SDKs (their DEFAULT_CONNECTION_LIMITS), with a margin for a request in flight."""
    import anthropic._constants
    import httpx2
    import openai._constants

    from helios.cli import hypercorn_config
    from helios.config import HeliosConfig

    expiries = [httpx.Limits().keepalive_expiry, httpx2.Limits().keepalive_expiry,
                openai._constants.DEFAULT_CONNECTION_LIMITS.keepalive_expiry,
                anthropic._constants.DEFAULT_CONNECTION_LIMITS.keepalive_expiry]
    assert all(e is not None for e in expiries)
    assert hypercorn_config(HeliosConfig()).keep_alive_timeout >= 10 * max(e or 0 for e in expiries)


def test_bursts_through_a_pooled_client_see_no_transport_error(server: ScriptedServer) -> None:
    outcomes = asyncio.run(_bursts(server.url))
    assert sum(outcomes.values()) == REQUESTS
    errors = {k: v for k, v in outcomes.items() if not k.isdigit()}
    assert not errors, outcomes
    assert set(outcomes) <= {"200", "429", "503"}, outcomes
    # The bursts went past admission: 429s (HTTP slots) and 503s (the model queue) as well as answers.
    assert outcomes["200"] > 100 and outcomes["429"] > 100 and outcomes["503"] > 0, outcomes


def test_the_server_waits_for_a_slow_model_load() -> None:
    """The model loads in the lifespan startup; hypercorn's own 60 s would end a slow first start."""
    from helios.cli import hypercorn_config
    from helios.config import HeliosConfig

    assert hypercorn_config(HeliosConfig()).startup_timeout >= 3600
