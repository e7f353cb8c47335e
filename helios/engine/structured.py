"""Structured output in the engine: llguidance vocabularies, compiled constraints and the batch's token mask.

A constrained request carries a `GrammarConstraint` (compiled before admission by the serving side,
`helios.serving.structured`): an llguidance matcher template for the answer grammar, and the
`Envelope` of the model family's reasoning and tool-call syntax in single token ids. The scheduler
gives each such request an `output_tracker.OutputTracker` (a private copy of the matcher plus the
gate that leaves reasoning and tool envelopes free, and any reasoning budget) and feeds it every
committed token; grammar-forced tokens are committed there too. The runner asks the batch's trackers
for their masks.

Masks: `GrammarBatch` fills one int32 bitmask row per masked request with llguidance's batched fill
(`LLExecutor`, Rust threads, GIL released) on a helper thread while the model's forward pass runs,
and unpacks it there to the boolean [rows, vocab] mask `Sampler.sample(token_mask=...,
masked_rows=...)` takes. Rows of unconstrained requests, and constrained ones inside a free envelope,
are not in it and keep the sampler's vectorised path. Logprobs are taken from the raw logits before
the mask.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

import attrs
import llguidance
import numpy as np
import torch

_WHITESPACE = frozenset(b" \t\r\n")


@attrs.frozen
class Envelope:
    """The model family's free regions, in single token ids (None: the family has none, or the
    tokenizer spells it in several tokens)."""

    reasoning_open: int | None = None
    reasoning_close: int | None = None
    tool_open: int | None = None
    tool_close: int | None = None
    starts_in_reasoning: bool = False
    """The prompt left reasoning open: output starts inside it."""
    tool_call_ends_reasoning: bool = False
    """A tool opener inside reasoning ends it (Qwen)."""

    @property
    def is_trivial(self) -> bool:
        return not self.starts_in_reasoning and self.reasoning_open is None and self.tool_open is None


class GrammarVocab:
    """The model's tokenizer as llguidance sees it (built once per model; ~0.2 s for 49k tokens),
    and the ids of whitespace-only tokens (the gate's separators)."""

    def __init__(self, tokenizer: Any) -> None:
        self.vocab_size: int = int(tokenizer.vocab_size)
        self.eos_token_ids: tuple[int, ...] = tuple(tokenizer.eos_token_ids)
        token_bytes = [bytes(b) for b in tokenizer.all_token_bytes()]
        special = sorted(int(i) for i in tokenizer.special_token_ids)
        self.whitespace_ids: frozenset[int] = frozenset(
            i for i, b in enumerate(token_bytes) if b and i not in special and set(b) <= _WHITESPACE)
        self.whitespace_array = np.array(sorted(self.whitespace_ids), dtype=np.int64)
        tokenize = _Tokenize(tokenizer, token_bytes, special)
        self.missing_bytes: frozenset[int] = tokenize.missing
        """Bytes no ordinary token holds: a grammar that forces one cannot be followed."""
        wrapper = llguidance.TokenizerWrapper(tokenize)
        self.ll_tokenizer = llguidance.LLTokenizer(wrapper, eos_token=list(self.eos_token_ids) or None)
        self._json_tokenizer: Any = None

    @property
    def json_tokenizer(self) -> Any:
        """The same tokenizer with llguidance's JSON slices: exact masks for any grammar, computed
        several times faster for JSON-schema grammars than with the general slices."""
        if self._json_tokenizer is None:
            self._json_tokenizer = self.ll_tokenizer.with_slices(llguidance.LLTokenizer.json_slices())
        return self._json_tokenizer


class _Tokenize:
    """What `llguidance.TokenizerWrapper` reads: token bytes, special ids, EOS/BOS, an encoder."""

    def __init__(self, tokenizer: Any, token_bytes: list[bytes], special: list[int]) -> None:
        self._tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_token_ids[0] if tokenizer.eos_token_ids else None
        self.bos_token_id = tokenizer.bos_token_id
        self.tokens = token_bytes
        self.special_token_ids = special
        ordinary = set(range(len(token_bytes))) - set(special)
        self.missing = frozenset(range(256)) - {b for i in ordinary for b in token_bytes[i]}
        """Bytes no ordinary token holds (SmolLM2 has none with 0xF1, the lead byte of U+40000 ..
        U+7FFFF): text with them cannot be generated, and the tokenizer would drop them silently."""

    def __call__(self, text: str | bytes) -> list[int]:
        data = text if isinstance(text, bytes) else text.encode("utf-8", errors="surrogatepass")
        missing = self.missing.intersection(data)
        if missing:
            # llguidance tokenizes the bytes a grammar forces: tokens for the rest only would make it
            # commit the wrong text. Raised, the matcher fails (GrammarCompiler probes for this).
            raise UnproducibleText(f"no token of this vocabulary holds the byte(s) {_hex(missing)}")
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return list(self._tokenizer.encode(text, add_special_tokens=False))


class UnproducibleText(ValueError):
    """Text that needs bytes no token of the vocabulary holds."""


UNPRODUCIBLE_MESSAGE = ("the grammar requires text this model cannot generate (its vocabulary has no token for "
                        "some of the text's bytes)")


def _hex(values: Iterable[int]) -> str:
    return ", ".join(f"0x{b:02X}" for b in sorted(values))


@attrs.frozen(eq=False)
class GrammarConstraint:
    """A compiled answer grammar for one request: what crosses into the engine in `EngineRequest`.

    ``matcher`` is the compiled template (never advanced; each request runs a deep copy, which
    shares the compiled grammar). ``vocab`` is the model's `GrammarVocab`."""

    matcher: Any
    vocab: GrammarVocab
    envelope: Envelope = Envelope()
    description: str = ""
    """What the constraint is (for error messages): e.g. "response_format (json_schema)"."""
    grammar: str = ""
    """The llguidance grammar it was compiled from."""
    json_slices: bool = False
    """Whether it was compiled against the vocabulary's JSON slices (`GrammarVocab.json_tokenizer`)."""

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        """Pickled as its grammar (a data-parallel rank process, `engine/dp.py`): the receiving
        process compiles it again against its own vocabulary (`set_process_vocab`). llguidance's
        compiled matcher does not pickle."""
        return _recompiled, (self.grammar, self.json_slices, self.envelope, self.description)


_process_vocab: Any = None
"""This process's `GrammarVocab`, or a callable that builds it (a rank's tokenizer is loaded
before any constraint arrives; the vocabulary is built at the first one, ~0.2 s)."""


def set_process_vocab(vocab: GrammarVocab | Any) -> None:
    """Name the vocabulary unpickled constraints compile against: a `GrammarVocab` or a callable
    returning one (built on first use)."""
    global _process_vocab
    _process_vocab = vocab


def _recompiled(grammar: str, json_slices: bool, envelope: Envelope, description: str) -> GrammarConstraint:
    global _process_vocab
    if _process_vocab is None:
        raise RuntimeError("a grammar constraint arrived in a process without a vocabulary (set_process_vocab)")
    if not isinstance(_process_vocab, GrammarVocab):
        _process_vocab = _process_vocab()
    vocab: GrammarVocab = _process_vocab
    matcher = llguidance.LLMatcher(vocab.json_tokenizer if json_slices else vocab.ll_tokenizer, grammar, log_level=0)
    if matcher.is_error():  # it compiled in the front, against the same tokenizer
        raise RuntimeError(f"the grammar did not compile again: {matcher.get_error()}")
    return GrammarConstraint(matcher, vocab, envelope, description=description, grammar=grammar,
                             json_slices=json_slices)


class MaskSource(Protocol):
    """What a step's mask fill reads of one constrained row (`output_tracker.OutputTracker`)."""

    @property
    def is_masking(self) -> bool: ...

    @property
    def constraint(self) -> GrammarConstraint | None: ...

    @property
    def matcher(self) -> Any: ...

    def extra_allowed(self) -> Sequence[int]: ...

    def allows_whitespace(self) -> bool: ...


class GrammarBatch:
    """The token masks of one step's constrained rows, filled in the background during the forward.

    `start(states)` takes the step's sampling rows' `OutputTracker`s (None for rows without one)
    and returns a `MaskJob`; `MaskJob.result()` waits for the fill and returns the boolean mask of
    the masked rows and their row indices (None when no row is masked)."""

    def __init__(self, vocab_size: int, *, num_threads: int | None = None, overlap: bool = True) -> None:
        self.vocab_size = vocab_size
        self.overlap = overlap
        """Fill on the helper thread during the forward (False: on the engine thread, before it)."""
        self._executor: Any = None
        self._num_threads = num_threads
        self._helper: ThreadPoolExecutor | None = None
        self._bitmask: torch.Tensor | None = None
        self.num_fills = 0
        self.fill_ns = 0
        """Total time of the mask fills (the helper thread's, overlapped with the forward)."""
        self.result_ns = 0
        """Total time the engine thread spent in `MaskJob.result`: waiting for a fill the forward did
        not hide, and unpacking the bitmask into the sampler's mask (the exposed cost)."""

    def start(self, states: Sequence[MaskSource | None]) -> MaskJob | None:
        rows = [i for i, s in enumerate(states) if s is not None and s.is_masking]
        if not rows:
            return None
        masked = [s for s in states if s is not None and s.is_masking]
        # One model, one vocabulary: every constraint of the step shares its `GrammarVocab`.
        vocab = masked[0].constraint.vocab if masked[0].constraint is not None else None
        assert vocab is not None  # a masking tracker has a grammar
        # llguidance wants exactly one bit per token of its tokenizer (the model's logits may be
        # padded wider; `MaskJob.result` fits the mask to them).
        words = (vocab.ll_tokenizer.vocab_size + 31) // 32
        if self._bitmask is None or self._bitmask.shape[0] < len(rows) or self._bitmask.shape[1] != words:
            with torch.inference_mode(False):
                self._bitmask = torch.full((max(len(rows), 8), words), -1, dtype=torch.int32)
        if self._executor is None:
            self._executor = llguidance.LLExecutor(self._num_threads)
        if self._helper is None and self.overlap:
            self._helper = ThreadPoolExecutor(1, thread_name_prefix="helios-grammar")
        bitmask = self._bitmask[: len(rows)]
        if self.overlap:
            assert self._helper is not None
            future = self._helper.submit(self._fill, masked, vocab, bitmask)
        else:
            future = Future()
            future.set_result(self._fill(masked, vocab, bitmask))
        return MaskJob(self, future, rows)

    def _fill(self, states: list[MaskSource], vocab: GrammarVocab,
              bitmask: torch.Tensor) -> tuple[np.ndarray, int]:
        """The masked rows' boolean masks over the model's vocabulary, and the fill's time in ns:
        llguidance's batched fill (GIL released), then the bits unpacked and the gate's extra
        tokens added, all off the engine thread when overlapped."""
        t0 = time.perf_counter_ns()
        # llguidance.torch.fill_next_token_bitmask_par, without importing torch.compile machinery.
        self._executor.unsafe_compute_mask_ptr([(s.matcher, k) for k, s in enumerate(states)], bitmask.data_ptr(),
                                               bitmask.shape[1] * 4, bitmask.shape[0])
        elapsed = time.perf_counter_ns() - t0
        vocab_size = self.vocab_size
        bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")
        width = min(bits.shape[1], vocab.ll_tokenizer.vocab_size)
        if width >= vocab_size:
            allowed = bits[:, :vocab_size].view(np.bool_)
        else:  # tokens beyond the tokenizer's vocabulary (padding) are never allowed
            allowed = np.zeros((bits.shape[0], vocab_size), dtype=np.bool_)
            allowed[:, :width] = bits[:, :width].view(np.bool_)
        for k, state in enumerate(states):
            extra = [t for t in state.extra_allowed() if t < vocab_size]
            if extra:
                allowed[k, extra] = True
            if state.allows_whitespace():
                ws = vocab.whitespace_array
                allowed[k, ws[ws < vocab_size]] = True
        return allowed, elapsed

    def close(self) -> None:
        if self._helper is not None:
            self._helper.shutdown(wait=False)


@attrs.define
class MaskJob:
    """One step's mask fill, running or done."""

    batch: GrammarBatch
    future: Future[tuple[np.ndarray, int]]
    rows: list[int]

    def result(self, vocab_size: int, device: torch.device) -> tuple[torch.Tensor, list[int]]:
        """The [len(rows), vocab_size] boolean mask (True: allowed) on ``device`` and the rows."""
        t0 = time.perf_counter_ns()
        allowed, elapsed = self.future.result()
        assert allowed.shape[1] == vocab_size
        self.batch.num_fills += 1
        self.batch.fill_ns += elapsed
        mask = torch.from_numpy(allowed)
        if device.type != "cpu":
            mask = mask.to(device, non_blocking=True)
        self.batch.result_ns += time.perf_counter_ns() - t0
        return mask, self.rows
