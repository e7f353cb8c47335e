"""The access log: line formatting, the per-request stats record, config keys, and the app's lines
for requests that need no model (404, 401, 503)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import trio

from helios.app import HeliosApp
from helios.cli import main as cli_main
from helios.config import ConfigError, HeliosConfig, ServerConfig, load_config
from helios.obs import access
from helios.obs.access import RequestStats, format_line


def scope(path: str = "/v1/chat/completions", query: bytes = b"", method: str = "POST",
          client: tuple[str, int] | None = ("127.0.0.1", 51234)) -> dict[str, Any]:
    return {"type": "http", "method": method, "path": path, "raw_path": path.encode(), "query_string": query,
            "headers": [], "client": client}


# -- formatting ------------------------------------------------------------------------------------


def test_generation_line() -> None:
    s = RequestStats(started=100.0)
    s.sent({"type": "http.response.start", "status": 200, "headers": [(b"x-request-id", b"req-abc")]})
    s.observe((1, 0), "chatcmpl-1", 23, 4, True)
    s.first_token = 100.412
    s.observe((1, 0), "chatcmpl-1", 23, 9, True)
    s.sent({"type": "http.response.body", "body": b"{}", "more_body": False})
    line = format_line(s, scope(), now=101.033)
    assert line == '127.0.0.1:51234 "POST /v1/chat/completions" 200 id=req-abc prompt=23 output=9 ttft=0.412s total=1.033s'


def test_non_generation_line_has_dashes() -> None:
    s = RequestStats(started=5.0)
    s.sent({"type": "http.response.start", "status": 200, "headers": []})
    s.sent({"type": "http.response.body", "body": b"x"})
    line = format_line(s, scope("/v1/models", b"a=1&b=2", "GET", ("::1", 8080)), now=5.0021)
    assert line == '[::1]:8080 "GET /v1/models?a=1&b=2" 200 id=- prompt=- output=- ttft=- total=0.002s'


def test_line_escapes_quotes_and_control_characters() -> None:
    s = RequestStats(started=0.0)
    s.sent({"type": "http.response.start", "status": 404, "headers": [(b"X-Request-Id", b"r 1")]})
    sc = scope('/a"b\\c', b"q=\n\xe9", "GET", None)
    sc["raw_path"] = b'/a"b\\c'
    line = format_line(s, sc, now=0.0)
    assert line == '- "GET /a\\"b\\\\c?q=\\n\\xe9" 404 id=r_1 prompt=- output=- ttft=- total=0.000s'
    assert "\n" not in line


def test_children_sum_outputs_and_count_a_shared_prompt_once() -> None:
    s = RequestStats(started=0.0)
    # One generate() call, n=2 of one prompt (10 tokens) plus another prompt (7 tokens).
    s.observe((1, 0), "a", 10, 3, True)
    s.observe((1, 0), "b", 10, 5, True)
    s.observe((1, 1), "c", 7, 2, True)
    s.observe((1, 0), "a", 0, 4, True)  # a later output without the prompt count keeps it
    # A second generate() call of the same request (decisions) adds its own prompt.
    s.observe((2, 0), "d", 10, 1, True)
    assert (s.prompt_tokens, s.output_tokens) == (27, 12)


def test_no_first_token_no_ttft() -> None:
    s = RequestStats(started=0.0)
    s.sent({"type": "http.response.start", "status": 200, "headers": []})
    s.observe((1, 0), "a", 10, 0, False)
    assert "prompt=10 output=0 ttft=- " in format_line(s, scope(), now=1.0)


def test_disconnect_before_completion_only() -> None:
    s = RequestStats(started=0.0)
    s.received({"type": "http.request", "body": b"", "more_body": False})
    assert not s.disconnected
    s.sent({"type": "http.response.start", "status": 200, "headers": []})
    s.received({"type": "http.disconnect"})
    assert s.disconnected
    assert format_line(s, scope(), now=0.0).endswith("disconnected=true")

    done = RequestStats(started=0.0)
    done.sent({"type": "http.response.start", "status": 200, "headers": []})
    done.sent({"type": "http.response.body", "body": b"", "more_body": False})
    done.received({"type": "http.disconnect"})
    assert not done.disconnected

    gone = RequestStats(started=0.0)
    gone.received({"type": "http.disconnect"})
    assert ' "POST /v1/chat/completions" - id=-' in format_line(gone, scope(), now=0.0)


def test_app_that_sent_nothing_is_logged_as_the_500_the_server_sends() -> None:
    line = format_line(RequestStats(started=0.0), scope(), now=0.0)
    assert " 500 " in line and line.endswith("error=no_response")


@pytest.mark.parametrize(("data", "event", "expected"), [
    ({"error": {"type": "server_error", "message": "m", "param": None, "code": None}}, None, "server_error"),
    ({"type": "error", "error": {"type": "overloaded_error", "message": "m"}}, "error", "overloaded_error"),
    ({"type": "response.failed", "response": {"error": {"code": "server_error", "message": "m"}}},
     "response.failed", "server_error"),
    ({"id": "x", "object": "chat.completion.chunk", "choices": []}, None, None),
    ({"type": "response.completed", "response": {"error": None}}, "response.completed", None),
    ("[DONE]", None, None),
])
def test_terminal_error_events(data: Any, event: str | None, expected: str | None) -> None:
    s = RequestStats()
    s.stream_event(data, event)
    assert s.error == expected


# -- the app ---------------------------------------------------------------------------------------


def run_app(app: HeliosApp, sc: dict[str, Any]) -> list[dict[str, Any]]:
    sent: list[dict[str, Any]] = []

    async def main() -> None:
        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        await app(sc, receive, send)

    trio.run(main)
    return sent


def access_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "helios.access"]


def test_app_logs_the_status_it_sent(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="helios.access")
    app = HeliosApp(HeliosConfig())  # no runtime: model routes answer 503
    sent = run_app(app, scope("/v1/models", method="GET"))
    run_app(app, scope("/nowhere", method="GET"))
    rid = dict(sent[0]["headers"])[b"x-request-id"].decode()
    lines = access_lines(caplog)
    assert len(lines) == 2
    assert lines[0].startswith(f'127.0.0.1:51234 "GET /v1/models" 503 id={rid} prompt=- output=- ttft=- total=')
    assert ' "GET /nowhere" 404 id=req-' in lines[1]
    for r in caplog.records:
        if r.name == "helios.access":
            assert r.levelno == logging.INFO


def test_app_logs_401(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="helios.access")
    app = HeliosApp(HeliosConfig(server=ServerConfig(api_key="k")))
    run_app(app, scope("/v1/models", method="GET"))
    assert ' "GET /v1/models" 401 ' in access_lines(caplog)[0]


def test_access_log_off(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="helios.access")
    app = HeliosApp(HeliosConfig(server=ServerConfig(access_log=False)))
    sent = run_app(app, scope("/nowhere", method="GET"))
    assert sent[0]["status"] == 404
    assert access_lines(caplog) == []
    assert access.current() is None


# -- configuration and CLI ------------------------------------------------------------------------


def test_config_keys(tmp_path: Path) -> None:
    assert (HeliosConfig().server.access_log, HeliosConfig().server.log_level) == (True, "info")
    cfg = tmp_path / "h.toml"
    cfg.write_text('[server]\naccess_log = false\nlog_level = "debug"\n')
    c = load_config(cfg)
    assert (c.server.access_log, c.server.log_level) == (False, "debug")
    for body, msg in [('[server]\nlog_level = "verbose"\n', "server.log_level must be one of"),
                      ('[server]\naccess_log = "yes"\n', "server.access_log must be true or false"),
                      ("[server]\naccess_logs = true\n", "access_logs")]:
        cfg.write_text(body)
        with pytest.raises(ConfigError, match=msg):
            load_config(cfg)


def test_cli_log_level_choices(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli_main(["serve", "--log-level", "verbose"])
    assert exc.value.code == 2
    assert "--log-level" in capsys.readouterr().err


def test_cli_rejects_a_bad_log_level_in_the_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "h.toml"
    cfg.write_text('[server]\nlog_level = "loud"\n')
    assert cli_main(["serve", "--config", str(cfg), "--no-access-log"]) == 2
    assert "server.log_level must be one of debug, info, warning, error" in capsys.readouterr().err
