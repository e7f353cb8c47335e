"""The chat page's static files (helios/http/static): served from the package, no external assets,
the stream request asks for usage, the routes cover every file the page loads."""

from __future__ import annotations

import re

from helios.http import webui


def test_every_route_serves_a_packaged_file() -> None:
    for path in webui.FILES:
        assert webui._read(webui.FILES[path][0])
    assert {p for _, p, _ in webui.ROUTES} == set(webui.FILES)


def test_the_page_loads_only_its_own_files() -> None:
    html = webui._read("index.html").decode()
    refs = set(re.findall(r'(?:src|href)="([^"]+)"', html))
    assert refs == {"/ui/chat.js", "/ui/chat.css"}
    assert refs <= set(webui.FILES)
    for name in ("index.html", "chat.js", "chat.css"):
        text = webui._read(name).decode()
        assert not re.search(r"https?://", text), f"{name} names an external URL"


def test_the_script_streams_chat_completions_with_usage() -> None:
    js = webui._read("chat.js").decode()
    assert '"/v1/chat/completions"' in js and "include_usage: true" in js and "stream: true" in js
    assert "prompt_tokens_details" in js and "cached_tokens" in js
    assert "localStorage" in js
