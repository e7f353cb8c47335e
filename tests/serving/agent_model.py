"""A scripted coding agent: a test model that plays a fixed inspect, edit, test task for a coding client.

`AgentModel` replaces the transformer as `harness.ScriptedModel` does, but decides what to write
from the whole context instead of a key, so it can serve a real client's multi-turn session with
the prefix cache on:

- Its KV cache holds each token's id (V[..., 0]; K is 0), a function of the token alone, so a page
  the prefix cache or its host store hands to a later request is exactly right for it. For every
  chunk that ends at a sampled position the model reads its whole context back from the paged cache
  through the step's block table (`AttentionInputs`, captured by a thin wrapper around the engine's
  attention backend). A wrong page from the prefix cache therefore shows up as a wrong transcript.
- The prompt is the context up to the generation prompt (the last `<|im_start|>assistant\\n`, an
  empty `<think></think>` after it included); the tokens after it are what the model already wrote.
  It writes `AgentTask.reply(prompt)` token by token, then EOS. Nothing is kept per request.

`AgentTask.reply` plays the task when the prompt holds `TASK` and declares a client's tools
(Codex: `apply_patch` and a shell tool; Claude Code: `Read`, `Edit`, `Bash`; OpenCode: `read`,
`edit`, `bash`): read `calc.py`, fix it (Codex through its freeform `apply_patch`, the others
through their edit tools), run `python3 test_calc.py`, then answer. The step is the number of tool
results after the task in the prompt. Calls are written in the served family's tool-call syntax
(`harness.Writer`). Any other prompt (a client's background requests) gets `harness.DEFAULT_REPLY`.
"""

from __future__ import annotations

import re
import threading
from typing import Any

import attrs
import torch

from helios.config import EngineSection, HeliosConfig, ModelConfigSection, ServerConfig
from helios.engine.attention import AttentionInputs, GroupAttention, PagedAttention, TorchPagedBackend
from helios.loaders.tokenizer import Tokenizer
from tests.serving.harness import (
    DEFAULT_REPLY,
    NEG,
    Family,
    ScriptedConfig,
    ScriptedInterface,
    ScriptedServer,
    Writer,
    scripted_tokenizer,
)

TASK = "Fix the bug in calc.py so that python3 test_calc.py passes."
CALC_BEFORE = "def add(a, b):\n    return a - b\n"
CALC_AFTER = "def add(a, b):\n    return a + b\n"
TEST_CALC = (
    "import pathlib\n\nfrom calc import add\n\n"
    "assert add(2, 3) == 5, f'add(2, 3) == {add(2, 3)}'\n"
    "pathlib.Path('tests-ran.txt').write_text('passed\\n')\n"
    "print('1 passed')\n"
)
TEST_COMMAND = "python3 test_calc.py"
PATCH = (
    "*** Begin Patch\n*** Update File: calc.py\n@@\n def add(a, b):\n-    return a - b\n+    return a + b\n"
    "*** End Patch\n"
)
ANSWER = "Fixed `add` in calc.py (it subtracted; it now returns `a + b`), and `python3 test_calc.py` passes."
CODEX_SHELLS = ("shell_command", "exec_command", "shell")

# Long enough for every client's full system prompt and tool list, several turns deep.
AGENT_MAX_MODEL_LEN = 65536


def write_project(root: Any) -> None:
    """The task's repository content (the caller runs `git init`)."""
    (root / "calc.py").write_text(CALC_BEFORE)
    (root / "test_calc.py").write_text(TEST_CALC)


@attrs.define
class Decision:
    """One prompt the agent answered: which client it recognised and the task step it played."""

    client: str | None
    step: int | None
    prompt_tokens: int


class AgentTask:
    """The task's script for each client, chosen from the tools the prompt declares."""

    def __init__(self, family: str, workdir: str = ".") -> None:
        self.writer = Writer(family)
        self.workdir = workdir
        self.decisions: list[Decision] = []
        self._lock = threading.Lock()

    @staticmethod
    def declared_tools(prompt: str) -> set[str]:
        """Tool names in the prompt's tool list (`<tools>` lines, one JSON object per tool)."""
        start = prompt.find("<tools>\n")
        block = prompt[start: prompt.find("\n</tools>", start)] if start >= 0 else ""
        return set(re.findall(r'"name":\s*"([^"]+)"', block))

    @staticmethod
    def client_of(tools: set[str]) -> str | None:
        if "apply_patch" in tools and tools & set(CODEX_SHELLS):
            return "codex"
        if {"Read", "Edit", "Bash"} <= tools:
            return "claude"
        if {"read", "edit", "bash"} <= tools:
            return "opencode"
        return None

    def reply(self, prompt: str, prompt_tokens: int) -> str:
        tools = self.declared_tools(prompt)
        client = self.client_of(tools) if TASK in prompt else None
        step = prompt[prompt.rfind(TASK):].count("<tool_response>") if client else None
        with self._lock:
            self.decisions.append(Decision(client, step, prompt_tokens))
        if client is None or step is None:
            return DEFAULT_REPLY
        calls = self._steps(client, tools)
        if step >= len(calls):
            return ANSWER
        name, args = calls[step]
        return self.writer.call(name, args)

    def _steps(self, client: str, tools: set[str]) -> list[tuple[str, dict[str, Any]]]:
        path = f"{self.workdir.rstrip('/')}/calc.py"
        if client == "codex":
            shell = next(s for s in CODEX_SHELLS if s in tools)
            def run(command: str) -> tuple[str, dict[str, Any]]:
                if shell == "exec_command":
                    return shell, {"cmd": command, "workdir": self.workdir}
                return shell, {"command": command if shell == "shell_command" else ["bash", "-lc", command],
                               "workdir": self.workdir}
            return [run("cat calc.py"), ("apply_patch", {"input": PATCH}), run(TEST_COMMAND)]
        if client == "claude":
            return [("Read", {"file_path": path}),
                    ("Edit", {"file_path": path, "old_string": "return a - b", "new_string": "return a + b"}),
                    ("Bash", {"command": TEST_COMMAND, "description": "Run the tests"})]
        return [("read", {"filePath": path}),
                ("edit", {"filePath": path, "oldString": "return a - b", "newString": "return a + b"}),
                ("bash", {"command": TEST_COMMAND, "description": "Run the tests"})]


class _CapturingBackend:
    """The engine's attention backend, recording each step's `AttentionInputs` for the model."""

    def __init__(self, inner: TorchPagedBackend) -> None:
        self.inner = inner
        self.name = inner.name
        self.kv = inner.kv
        self.inputs: AttentionInputs | None = None

    def build(self, inputs: AttentionInputs) -> PagedAttention | GroupAttention:
        self.inputs = inputs
        return self.inner.build(inputs)

    def read_page(self, page: int, group: int = 0) -> bytes:
        return self.inner.read_page(page, group)

    def write_page(self, page: int, data: bytes, group: int = 0) -> bool:
        return self.inner.write_page(page, data, group)


class AgentModel(ScriptedInterface, torch.nn.Module):
    """`forward(input_ids, positions, attn) -> hidden` (each row's next token id) and
    `compute_logits`, like `ScriptedModel`; see the module docstring."""

    def __init__(self, tok: Tokenizer, task: AgentTask, config: ScriptedConfig, eos_token_id: int) -> None:
        super().__init__()
        self.tok = tok
        self.task = task
        self.config = config
        self.eos_token_id = eos_token_id
        self.page_size = 0
        self.backend: _CapturingBackend | None = None
        start = tok.token_to_id("<|im_start|>")
        assert start is not None
        self.im_start = start
        self.header = tuple(tok.encode("<|im_start|>assistant\n", add_special_tokens=False))
        self.empty_think = tuple(tok.encode("<think>\n\n</think>\n\n", add_special_tokens=False))
        self._replies: dict[int, tuple[int, ...]] = {}

    def attach(self, core: Any) -> None:
        """Wraps the engine's attention backend (called by `harness.runtime_factory`)."""
        self.backend = _CapturingBackend(core.runner.backend)
        core.runner.backend = self.backend
        self.page_size = core.cfg.page_size

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: Any, *,
                keep: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self._forward(input_ids, positions, attn)
        return hidden if keep is None else hidden.index_select(0, keep)  # the model's `keep` contract

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: Any) -> torch.Tensor:
        assert self.backend is not None and self.backend.inputs is not None, "AgentModel.attach was not called"
        inputs = self.backend.inputs
        cache = self.backend.kv.v[0][0, :, 0]  # [slots]: the token id stored at each slot
        cache.index_copy_(0, inputs.slot_mapping, input_ids.to(cache.dtype))
        out = torch.full((input_ids.shape[0], 1), float(self.eos_token_id))
        ends = [(start + length - 1, row, ctx + length) for start, length, row, ctx in inputs.prefills]
        if inputs.num_decode:
            assert inputs.decode_tokens is not None and inputs.decode_rows is not None
            assert inputs.decode_lens is not None
            ends += zip(inputs.decode_tokens.tolist(), inputs.decode_rows.tolist(), inputs.decode_lens.tolist(),
                        strict=True)
        offsets = torch.arange(self.page_size)
        for index, row, length in ends:
            pages = inputs.block_table[row, : -(-length // self.page_size)]
            slots = (pages[:, None] * self.page_size + offsets).reshape(-1)[:length]
            out[index, 0] = float(self.next_token(cache.index_select(0, slots).long().tolist()))
        return out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = torch.full((hidden.shape[0], self.config.vocab_size), NEG, dtype=torch.float32)
        logits.scatter_(1, hidden[:, :1].long(), 0.0)
        return logits

    def next_token(self, context: list[int]) -> int:
        """The token after `context`: the reply to its prompt, continued where the context ends."""
        try:
            start = len(context) - 1 - context[::-1].index(self.im_start)
        except ValueError:
            return self.eos_token_id
        end = start + len(self.header)
        if tuple(context[start:end]) != self.header:
            return self.eos_token_id
        if tuple(context[end: end + len(self.empty_think)]) == self.empty_think:
            end += len(self.empty_think)
        prompt = context[:end]
        key = hash(tuple(prompt))
        reply = self._replies.get(key)
        if reply is None:
            text = self.task.reply(self.tok.decode(prompt, skip_special_tokens=False), len(prompt))
            reply = tuple(self.tok.encode(text, add_special_tokens=False))
            self._replies[key] = reply
        index = len(context) - end
        return reply[index] if index < len(reply) else self.eos_token_id


def agent_config(max_model_len: int = AGENT_MAX_MODEL_LEN) -> HeliosConfig:
    """A long context, room for several sessions' histories in the prefix cache. A prompt arrives in
    one chunk: the model answers at every chunk's end and only the last one's answer is sampled."""
    return HeliosConfig(
        server=ServerConfig(aliases=["scripted"], max_concurrency=32, default_max_tokens=1024, frontend_workers=2),
        model=ModelConfigSection(max_model_len=max_model_len),
        engine=EngineSection(page_size=16, kv_pages=4 * max_model_len // 16, prefill_chunk_size=max_model_len, max_active=8),
    )


def agent_server(family: Family, task: AgentTask) -> ScriptedServer:
    """A scripted server (not started) whose model plays `task`, with the prefix cache on."""
    tok = scripted_tokenizer()
    return ScriptedServer(family, config=agent_config(), prefix_caching=True,
                          model_factory=lambda mc, eos: AgentModel(tok, task, mc, eos))
