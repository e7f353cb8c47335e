"""Serving tests with a scripted model (ARCHITECTURE.md, testing layer 3).

Everything but the transformer is real: the tokenizer (SmolLM2's, plus the Qwen markup tokens as
added single tokens), a family chat template from the fixtures, the recipe and its output parser,
the engine thread with its scheduler, paged KV cache and sampler, the serving pipeline, the ASGI app
and a hypercorn server on a real socket. Only the model is replaced: `ScriptedModel` puts all
probability mass on the next token of a script chosen for each request.

Choosing the script. A test registers token ids with `ScriptBook.add`, which returns a key such as
`[[case-7]]`; the test writes the key into its last user message. When the model sees a new prompt
(a prefill run starting at position 0) it decodes the prompt and picks the registered key that
occurs last in it, so earlier turns that mention other keys do not matter. A prompt without a key
gets `DEFAULT_REPLY`. After the script the model emits EOS (`<|im_end|>`).

Telling sequences apart. The engine hands the model only flattened input ids, positions and the
attention backend. The model gives each new sequence an integer id and stores it as the value of
every prompt token in the real paged KV cache (keys 0); tokens it decodes later store a key of -1e4,
so their softmax weight is 0. Attention over a sequence's own pages therefore returns its id
exactly, for any number of concurrent sequences. This needs float32 KV and prompts that arrive in
one prefill chunk (the harness sets prefill_chunk_size to the context length); it does not survive
preemption (recompute), which the harness's KV pool is large enough to avoid.
"""

from __future__ import annotations

import functools
import itertools
import json
import socket
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Self

import attrs
import httpx
import torch
import trio

from helios.app import HeliosApp
from helios.config import EngineSection, HeliosConfig, ModelConfigSection, ServerConfig
from helios.domain.model import ModelInfo
from helios.engine.core import EngineConfig, EngineCore
from helios.loaders.tokenizer import Tokenizer
from helios.models.interface import FullAttentionSpec
from helios.recipes import Recipe, get_recipe, plain_recipe
from helios.runtime import Runtime
from helios.serving.pipeline import Service
from tests.shared_fixtures import shared_fixtures

# The fixture chat templates (shared/ beside the repository); None when absent: the servers fixture skips.
TEMPLATES = shared_fixtures("chat_templates")

# Qwen's markup tokens: added, not special (they decode to their text, as in Qwen's tokenizer).
ADDED_TOKENS = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
EOS_TEXT = "<|im_end|>"
DEFAULT_REPLY = "OK."
MAX_MODEL_LEN = 4096
NEG = -1e4
HOLD_LIMIT_S = 10.0


# -- tokenizer ------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def scripted_tokenizer() -> Tokenizer:
    """SmolLM2's tokenizer (ChatML <|im_start|>/<|im_end|> specials) plus Qwen's markup tokens."""
    from tokenizers import AddedToken

    from helios.loaders.default_model import ensure_default_model
    from helios.loaders.gguf_loader import GGUFFile

    base = Tokenizer.from_gguf_metadata(GGUFFile(ensure_default_model(quiet=True)).metadata)
    backend = base.backend
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED_TOKENS])
    tok = Tokenizer(backend, bos_token_id=base.bos_token_id, eos_token_ids=base.eos_token_ids,
                    add_bos_token=base.add_bos_token, byte_encoding=base.byte_encoding)
    for t in ADDED_TOKENS:
        assert tok.encode(t, add_special_tokens=False) == [tok.token_to_id(t)], t
    return tok


def pieces(tok: Tokenizer, text: str) -> list[int]:
    """`text` written in ordinary pieces, one encode per character: never an added single token."""
    return [i for ch in text for i in tok.encode(ch, add_special_tokens=False)]


def encode_script(tok: Tokenizer, parts: Iterable[str | Sequence[int]]) -> list[int]:
    """Text parts are encoded normally (added tokens become single tokens); id lists pass as they are."""
    ids: list[int] = []
    for part in parts:
        ids.extend(tok.encode(part, add_special_tokens=False) if isinstance(part, str) else part)
    return ids


# -- the scripted model ---------------------------------------------------------------------------


@attrs.define
class Prefill:
    """One prompt the model saw: the key it chose and the exact prompt ids."""

    key: str | None
    prompt_ids: tuple[int, ...]


class ScriptBook:
    """Scripts by key, and the prompts the model received (thread-safe: the engine thread reads)."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok
        self._lock = threading.Lock()
        self._scripts: dict[str, tuple[int, ...]] = {}
        self._ids = itertools.count(1)
        self.prefills: list[Prefill] = []
        self._holds: dict[str, threading.Event] = {}
        self.hold_timed_out: dict[str, bool] = {}

    def hold(self, key: str) -> threading.Event:
        """The prefill of the next prompt selecting `key` waits until the returned event is set (a
        long prompt on a CPU); it gives up after HOLD_LIMIT_S and records that in `hold_timed_out`."""
        event = threading.Event()
        with self._lock:
            self._holds[key] = event
        return event

    def wait_hold(self, key: str | None) -> None:
        with self._lock:
            event = self._holds.pop(key, None) if key is not None else None
        if event is not None and key is not None:
            self.hold_timed_out[key] = not event.wait(HOLD_LIMIT_S)

    def add(self, *parts: str | Sequence[int]) -> str:
        """Registers a script (see `encode_script`) and returns the key to put in the prompt."""
        ids = tuple(encode_script(self.tok, parts))
        with self._lock:
            key = f"[[case-{next(self._ids)}]]"
            self._scripts[key] = ids
        return key

    def script(self, key: str) -> tuple[int, ...]:
        with self._lock:
            return self._scripts[key]

    def choose(self, prompt_ids: Sequence[int]) -> tuple[str | None, tuple[int, ...]]:
        text = self.tok.decode(prompt_ids, skip_special_tokens=False)
        with self._lock:
            found = [(text.rfind(k), k) for k in self._scripts if k in text]
            key = max(found)[1] if found else None
            self.prefills.append(Prefill(key, tuple(prompt_ids)))
            if key is None:
                return None, tuple(self.tok.encode(DEFAULT_REPLY, add_special_tokens=False))
            return key, self._scripts[key]

    def prompts_for(self, key: str) -> list[tuple[int, ...]]:
        with self._lock:
            return [p.prompt_ids for p in self.prefills if p.key == key]

    def prompt_text(self, key: str) -> str:
        """The (last) rendered prompt that selected `key`, special tokens included."""
        prompts = self.prompts_for(key)
        assert prompts, f"the model never saw a prompt with {key}"
        return str(self.tok.decode(list(prompts[-1]), skip_special_tokens=False))


@attrs.frozen
class ScriptedConfig:
    """The model shape EngineCore needs for its KV cache and sampler."""

    vocab_size: int
    num_layers: int = 1
    num_kv_heads: int = 1
    head_dim: int = 2


class ScriptedInterface:
    """The `models.interface.CausalLM` members the engine reads, for the scripted test models."""

    config: ScriptedConfig

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    def cache_specs(self) -> tuple[FullAttentionSpec, ...]:
        return (FullAttentionSpec(self.config.num_kv_heads, self.config.head_dim),) * self.config.num_layers

    def decode_weight_bytes(self) -> int:
        return 0  # no weights


@attrs.define
class _Seq:
    script: tuple[int, ...]
    num_prompt_tokens: int


class ScriptedModel(ScriptedInterface, torch.nn.Module):
    """`forward(input_ids, positions, attn) -> hidden` and `compute_logits(hidden) -> [N, vocab]`:
    hidden carries each row's next token id; logits put all mass on it."""

    def __init__(self, book: ScriptBook, config: ScriptedConfig, eos_token_id: int) -> None:
        super().__init__()
        self.book = book
        self.config = config
        self.eos_token_id = eos_token_id
        self._seqs: dict[int, _Seq] = {}
        self._ids = itertools.count(1)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: Any, *,
                keep: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self._forward(input_ids, positions, attn)
        return hidden if keep is None else hidden.index_select(0, keep)  # the model's `keep` contract

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: Any) -> torch.Tensor:
        ids, pos = input_ids.tolist(), positions.tolist()
        num = len(ids)
        carrier = torch.zeros(num, dtype=torch.float32)
        is_new = torch.zeros(num, dtype=torch.bool)
        i = 0
        while i < num:  # a run of positions 0, 1, 2, ... is a new sequence's whole prompt
            if pos[i] != 0:
                i += 1
                continue
            j = i + 1
            while j < num and pos[j] == pos[j - 1] + 1:
                j += 1
            key, key_script = self.book.choose(ids[i:j])
            self.book.wait_hold(key)  # in the engine thread, like a long prefill
            sid = next(self._ids)
            self._seqs[sid] = _Seq(key_script, j - i)
            carrier[i:j] = float(sid)
            is_new[i:j] = True
            i = j
        q = torch.zeros(num, 1, self.config.head_dim)
        q[:, 0, 0] = 1.0
        k = torch.zeros(num, 1, self.config.head_dim)
        k[~is_new, 0, 0] = NEG
        v = torch.zeros(num, 1, self.config.head_dim)
        v[:, 0, 0] = carrier
        seq_ids = attn(0, q, k, v)[:, 0, 0].round().long().tolist()
        return torch.tensor([[float(self._next_token(s, p))] for s, p in zip(seq_ids, pos, strict=True)])

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = torch.full((hidden.shape[0], self.config.vocab_size), NEG, dtype=torch.float32)
        logits.scatter_(1, hidden[:, :1].long(), 0.0)
        return logits

    def _next_token(self, sid: int, position: int) -> int:
        seq = self._seqs.get(sid)
        if seq is None:
            raise RuntimeError(f"scripted model: attention returned unknown sequence id {sid}")
        index = position + 1 - seq.num_prompt_tokens
        if 0 <= index < len(seq.script):
            return seq.script[index]
        return self.eos_token_id


# -- family markup for scripts ----------------------------------------------------------------------


class Writer:
    """A family's raw output markup, for writing scripts."""

    def __init__(self, family: str) -> None:
        self.family = family

    @property
    def prompt_opens_reasoning(self) -> bool:
        return self.family == "qwen3_coder"  # qwen3_5.jinja ends its generation prompt with "<think>\n"

    def think(self, reasoning: str) -> str:
        """Reasoning, closed, as the model writes it after the generation prompt."""
        opener = "" if self.prompt_opens_reasoning else "<think>\n"
        return f"{opener}{reasoning}\n</think>\n\n"

    def call(self, name: str, arguments: dict[str, Any]) -> str:
        if self.family in ("qwen3", "smollm2"):
            return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"
        params = "".join(
            f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v)}\n</parameter>\n" for k, v in arguments.items()
        )
        return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"

    def calls(self, *calls: tuple[str, dict[str, Any]]) -> str:
        return "\n".join(self.call(name, args) for name, args in calls)


# -- runtime ----------------------------------------------------------------------------------------

ModelFactory = Callable[[ScriptedConfig, int], torch.nn.Module]


@attrs.frozen
class Family:
    """A served model family: template fixture, recipe, and whether its prompt opens reasoning."""

    name: str
    template: str
    recipe: Callable[[], Recipe]


FAMILIES = {
    # Qwen3 hybrid thinking: the model opens <think> itself; Hermes JSON <tool_call> envelopes.
    "qwen3": Family("qwen3", "qwen3.jinja", lambda: plain_recipe(output_parser="qwen3")),
    # Qwen3.5 / Qwen3.8: the prompt ends in "<think>\n"; Qwen3-Coder <function=...> tags.
    "qwen3_coder": Family("qwen3_coder", "qwen3_5.jinja", lambda: get_recipe("qwen38")),
    # SmolLM2 (the default model's template): ChatML that ignores `tools`, so Helios writes the
    # tool prompt itself (lowering rule 8) and reads Hermes JSON calls back.
    "smollm2": Family("smollm2", "smollm2.jinja", lambda: plain_recipe()),
}


def serving_config() -> HeliosConfig:
    return HeliosConfig(
        server=ServerConfig(aliases=["scripted"], max_concurrency=32, default_max_tokens=512, frontend_workers=2),
        model=ModelConfigSection(max_model_len=MAX_MODEL_LEN),
        engine=EngineSection(page_size=16, kv_pages=2048, prefill_chunk_size=MAX_MODEL_LEN, max_active=16),
    )


def runtime_factory(family: Family, book: ScriptBook, *, model_factory: ModelFactory | None = None,
                    prefix_caching: bool = False) -> Callable[[HeliosConfig], Runtime]:
    """What HeliosApp's lifespan calls: a real Runtime (engine thread, EngineClient) around the
    scripted model, or around the model `model_factory` builds (called with the model shape, the EOS
    id and, once the engine exists, `attach(core)` on the model if it has one)."""

    def build(cfg: HeliosConfig) -> Runtime:
        tok = book.tok
        recipe = family.recipe()
        mc = ScriptedConfig(vocab_size=tok.vocab_size)
        eos = tok.token_to_id(EOS_TEXT)
        assert eos is not None and eos in tok.eos_token_ids
        model = ScriptedModel(book, mc, eos) if model_factory is None else model_factory(mc, eos)
        # No prefix cache for ScriptedModel: its K/V carry the identity of the request that computed
        # them (which script it follows), not a function of the tokens, so a reused page would hand a
        # new request another's script. (agent_model.AgentModel's K/V are a function of the tokens.)
        ecfg = EngineConfig(page_size=cfg.engine.page_size, num_pages=cfg.engine.kv_pages,
                            max_active=cfg.engine.max_active, prefill_chunk_size=cfg.engine.prefill_chunk_size,
                            max_model_len=cfg.model.max_model_len, prefix_caching=prefix_caching)
        core = EngineCore(model, ecfg, torch.float32, "cpu")
        if hasattr(model, "attach"):
            model.attach(core)
        info = ModelInfo(
            model_id=f"scripted-{family.name}",
            aliases=tuple(cfg.server.aliases),
            created=int(time.time()),
            max_model_len=cfg.model.max_model_len,
            vocab_size=tok.vocab_size,
            default_max_tokens=cfg.server.default_max_tokens,
            max_concurrency=cfg.engine.max_active,
            prefill_chunk_size=cfg.engine.prefill_chunk_size,
            max_top_logprobs=cfg.server.max_top_logprobs,
            prompt_logprobs=cfg.server.prompt_logprobs,
            sampling_defaults=recipe.sampling_defaults_json(),
            sampling_ranges=recipe.sampling_ranges_json(),
            recipe=recipe.name,
            has_bos=tok.bos_token_id is not None,
            thinking_token_budget=cfg.server.thinking_token_budget,
            clamp_max_tokens=cfg.server.max_tokens_overflow == "clamp",
            max_output_tokens=cfg.server.max_output_tokens,
            has_reasoning=recipe.reasoning_parser is not None or recipe.output_parser not in ("plain", "hermes"),
        )
        assert TEMPLATES is not None, "shared/fixtures/chat_templates not found"
        template = (TEMPLATES / family.template).read_text()
        return Runtime(cfg, core, info, tok, template, recipe, tuple(tok.eos_token_ids))

    return build


# -- an in-process hypercorn server -----------------------------------------------------------------


class AppServer:
    """A HeliosApp served by hypercorn's trio worker in a background thread, on a real socket."""

    def __init__(self, app: HeliosApp, name: str) -> None:
        self.app = app
        self.name = name
        self.url = ""
        self._token: trio.lowlevel.TrioToken | None = None
        self._stop: trio.Event | None = None
        self._thread: threading.Thread | None = None
        self._failure: BaseException | None = None

    def start(self) -> Self:
        from hypercorn.trio import serve

        from helios.cli import hypercorn_config

        port = _free_port()
        config = hypercorn_config(self.app.config)  # `helios serve`'s (keep-alive included)
        config.bind = [f"127.0.0.1:{port}"]
        config.errorlog = None
        config.graceful_timeout = 0.5
        self.url = f"http://127.0.0.1:{port}"

        async def main() -> None:
            self._token = trio.lowlevel.current_trio_token()
            self._stop = trio.Event()
            await serve(self.app, config, shutdown_trigger=self._stop.wait)  # type: ignore[arg-type]

        def run() -> None:
            try:
                trio.run(main)
            except BaseException as exc:
                self._failure = exc

        self._thread = threading.Thread(target=run, name=f"hypercorn-{self.name}", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self._failure is not None or not self._thread.is_alive():
                raise RuntimeError(f"{self.name} server failed to start: {self._failure!r}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"{self.name} server did not become healthy")

    def stop(self) -> None:
        if self._token is not None and self._stop is not None:
            try:
                trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
            except trio.RunFinishedError:
                pass
        if self._thread is not None:
            self._thread.join(30)

    def run_in_server(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Runs an async function in the server's trio loop (e.g. `Service.render_chat`)."""
        assert self._token is not None
        return trio.from_thread.run(fn, *args, trio_token=self._token)

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=60, headers={"anthropic-version": "2023-06-01"})


class ScriptedServer(AppServer):
    """The scripted model's HeliosApp on a real socket. `config` and `model_factory` replace the
    harness's serving configuration and scripted model."""

    def __init__(self, family: Family, *, config: HeliosConfig | None = None,
                 model_factory: ModelFactory | None = None, prefix_caching: bool = False) -> None:
        self.family = family
        self.book = ScriptBook(scripted_tokenizer())
        factory = runtime_factory(family, self.book, model_factory=model_factory, prefix_caching=prefix_caching)
        super().__init__(HeliosApp(config or serving_config(), runtime_factory=factory), family.name)

    @property
    def tok(self) -> Tokenizer:
        return self.book.tok

    @property
    def service(self) -> Service:
        assert self.app.service is not None
        return self.app.service

    # -- clients -----------------------------------------------------------------------------------
    def openai(self) -> Any:
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=60)

    def anthropic(self) -> Any:
        import anthropic

        return anthropic.Anthropic(base_url=self.url, api_key="unused", max_retries=0, timeout=60,
                                   default_headers={"anthropic-version": "2023-06-01"})



def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
