"""Anthropic cache_control markers reach the engine as a retention boundary, and change nothing else."""

from __future__ import annotations

from typing import Any

from helios.frontends.anthropic import messages as anthropic_frontend
from tests.serving.harness import ScriptedServer


def body(marked: bool) -> dict[str, Any]:
    cc = {"cache_control": {"type": "ephemeral"}} if marked else {}
    return {"model": "m", "max_tokens": 16, "system": "You are terse.", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "A long document about lighthouses.", **cc},
                                     {"type": "text", "text": "Summarize it."}]}]}


def test_the_marker_sets_the_retained_prefix_and_leaves_the_prompt_alone(servers: dict[str, ScriptedServer]) -> None:
    server = servers["smollm2"]
    svc = server.service
    plain = server.run_in_server(svc.prepare, anthropic_frontend.decode_request(body(False), svc.info).generation)
    marked = server.run_in_server(svc.prepare, anthropic_frontend.decode_request(body(True), svc.info).generation)
    assert marked.prompts == plain.prompts  # the prompt is unchanged
    assert plain.children[0].retain_tokens == 0
    retain = marked.children[0].retain_tokens
    ids = marked.prompts[0].token_ids
    assert 0 < retain < len(ids)
    kept = server.tok.decode(list(ids[:retain]), skip_special_tokens=False)
    assert kept.endswith("A long document about lighthouses.")
