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


def test_each_of_the_first_four_markers_reaches_the_engine(servers: dict[str, ScriptedServer]) -> None:
    """Five marked blocks over two user turns: the first four give ascending token counts, each
    ending its block's text; the last is the retained prefix."""
    server = servers["smollm2"]
    svc = server.service
    cc = {"cache_control": {"type": "ephemeral"}}
    texts = ["Part one about tides.", "Part two about reefs.", "Part three about gulls.", "Part four about kelp.",
             "Part five about sand."]
    req = {"model": "m", "max_tokens": 16, "messages": [
        {"role": "user", "content": [{"type": "text", "text": t, **cc} for t in texts[:2]]},
        {"role": "assistant", "content": "Noted."},
        {"role": "user", "content": [{"type": "text", "text": t, **cc} for t in texts[2:]]}]}
    prepared = server.run_in_server(svc.prepare, anthropic_frontend.decode_request(req, svc.info).generation)
    child = prepared.children[0]
    ids = prepared.prompts[0].token_ids
    assert len(child.marker_tokens) == 4 and list(child.marker_tokens) == sorted(set(child.marker_tokens))
    assert child.retain_tokens == child.marker_tokens[-1] < len(ids)
    for n, text in zip(child.marker_tokens, texts, strict=False):
        assert server.tok.decode(list(ids[:n]), skip_special_tokens=False).endswith(text)
