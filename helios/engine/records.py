"""Records that cross the engine thread boundary. Plain values only: tensors never leave the engine."""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs

from helios.domain.events import FailureKind
from helios.domain.logprobs import PromptLogprob, TokenLogprob
from helios.domain.sampling import SamplingParams

if TYPE_CHECKING:
    from helios.engine.speculative import SpeculativeStats
    from helios.engine.structured import GrammarConstraint
    from helios.engine.threads import ThreadStats


class EngineFinish(enum.Enum):
    """Terminal causes the engine itself decides. String stops are matched on the serving side."""

    EOS = "eos"
    STOP_TOKEN = "stop_token"
    LENGTH = "length"
    ABORTED = "aborted"
    ERROR = "error"


@attrs.frozen
class ReasoningBudget:
    """A hard cap on generated reasoning tokens (spec: ``thinking_token_budget``), in token ids.

    The engine follows reasoning by single tokens only (`engine/output_tracker.py`): it is open
    from the start when the prompt opened it (``close_token_id`` closes it), or when the first
    generated token is one of ``opens`` (opener id -> its close id). While open, every generated
    token counts, except one that closes reasoning or may end it (``end_token_ids``: a close
    delimiter, a tool opener that ends reasoning); after such a token the budget is done. Once
    ``max_tokens`` reasoning tokens are generated, the next token is the close token, forced in
    place of the sampled one (counted as generated, without a logprob entry)."""

    max_tokens: int
    close_token_id: int | None = None
    """The prompt left reasoning open; this token closes it (None: output starts undecided)."""
    opens: tuple[tuple[int, int], ...] = ()
    """(opener id, close id): a first generated opener opens reasoning, closed by its close id."""
    end_token_ids: frozenset[int] = frozenset()


GRAMMAR_FAILURE = "structured output failed"
"""How the error message of a request its grammar failed begins (its kind: `FailureKind.GRAMMAR`)."""


@attrs.frozen
class EngineFailure:
    """Why the runner failed one request in a step: the kind, and the error message it ends with."""

    kind: FailureKind
    message: str


@attrs.frozen
class ImageInput:
    """One image of a prompt, as the engine needs it (the contract: `domain/images.py`).

    The image's placeholder tokens lie in ``prompt_token_ids[offset : offset + length]`` (framing
    tokens between its tiles included); the k-th token of that span equal to the model's image token
    id takes row k of the image's ``tokens`` feature rows. ``identity`` (content digest and processing
    settings) enters the prefix-cache hash of every page the span touches. ``load`` returns the
    model's prepared input (decoded and preprocessed pixels); the engine calls it only when some of
    the span must be computed, never for a span a cached prefix covers."""

    offset: int
    length: int
    tokens: int
    identity: str
    load: Callable[[], Any] = attrs.field(eq=False, repr=False)


@attrs.frozen
class EngineRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    max_tokens: int
    eos_token_ids: frozenset[int] = frozenset()
    stop_token_ids: frozenset[int] = frozenset()
    stop_token_sequences: tuple[tuple[int, ...], ...] = ()
    """Multi-token stops: the request ends with STOP_TOKEN at the generated token that completes one
    (its generated tokens, never the prompt, end with the sequence). One-token stops belong in
    ``stop_token_ids``."""
    ignore_eos: bool = False
    min_tokens: int = 0
    """Until this many tokens are generated, EOS and ``stop_token_ids`` are masked from every draw
    (`SamplingRow.masks_stops`) and no token stop ends the request (vLLM's min_tokens)."""
    num_top_logprobs: int | None = None
    logprob_token_ids: tuple[int, ...] | None = None
    prompt_logprobs: int | None = None
    """None: no prompt scores; 0..20: score every prompt position with that many natural alternatives.
    With ``max_tokens == 0`` the request only scores its prompt and finishes with LENGTH."""
    marker_tokens: tuple[int, ...] = ()
    """Prompt tokens up to each of the client's prefix-checkpoint markers (the first four, in
    order): a recurrent layout's candidate ``message`` checkpoints (`kv/checkpoints.py`); the last
    is `retain_tokens`."""
    reasoning_budget: ReasoningBudget | None = None
    constraint: GrammarConstraint | None = None
    """A compiled answer grammar (structured output; `engine/structured.py`), None: unconstrained."""
    images: tuple[ImageInput, ...] = ()
    """The prompt's images in prompt order, spans disjoint (vision models only)."""

    @property
    def retain_tokens(self) -> int:
        """Prompt tokens up to the client's last prefix-checkpoint marker (0: none): their full
        pages are evicted from the prefix cache only after every unmarked page."""
        return self.marker_tokens[-1] if self.marker_tokens else 0


@attrs.frozen
class Add:
    request: EngineRequest


@attrs.frozen
class Abort:
    request_ids: tuple[str, ...]


@attrs.frozen
class Shutdown:
    pass


InboxItem = Add | Abort | Shutdown


@attrs.frozen
class RequestOutput:
    """What one engine step produced for one request.

    ``prompt_logprobs`` carries the prompt positions scored this step (requests with
    ``EngineRequest.prompt_logprobs``), in position order; position 0 has no score and is None.
    """

    request_id: str
    new_token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] | None = None
    prompt_logprobs: tuple[PromptLogprob | None, ...] | None = None
    finish: EngineFinish | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None
    failure: FailureKind | None = None
    """What failed the request, with every ERROR finish (``error`` says it in words)."""
    forced: tuple[int, ...] = ()
    """Indices into ``new_token_ids`` of tokens the engine forced in place of a sampled one (a
    reasoning budget's close token). They count as generated and have no ``logprobs`` entry."""
    produced_at: float = attrs.field(factory=time.perf_counter, eq=False)
    """``time.perf_counter()`` when this record was made. The scheduler makes a step's records as it
    commits their tokens (`Scheduler._commit`), so for ``new_token_ids`` this is the time the engine
    committed them: the clock of the token timestamps (``return_token_timestamps``)."""


@attrs.frozen
class RunnerOutput:
    """What one forward produced, by request id: the runner → scheduler boundary record.

    ``sampled`` holds each sampling request's tokens in order (its draw, or the chunk's forced
    token; under speculative verification the accepted drafts plus the bonus token), ``logprobs``
    their records in the same order (only for requests that asked; none for a forced token),
    ``prompt_logprobs`` the prompt positions scored in this step's chunks. The scheduler commits
    them, with any grammar-forced tokens after a sampled one (`Scheduler.update`)."""

    sampled: dict[str, tuple[int, ...]] = attrs.field(factory=dict)
    logprobs: dict[str, tuple[TokenLogprob, ...]] = attrs.field(factory=dict)
    prompt_logprobs: dict[str, tuple[PromptLogprob | None, ...]] = attrs.field(factory=dict)
    failed: dict[str, EngineFailure] = attrs.field(factory=dict)
    """Requests the step failed, with why (an image could not be prepared): the scheduler ends them
    with ERROR."""
    not_run: frozenset[str] = frozenset()
    """Failed requests whose chunk did not run at all (an image's load or encode failed): none of
    their positions count as computed and none of their pages are registered."""


@attrs.define
class Histogram:
    """Cumulative counts of observations at or below each bound (`le`), their sum and number: what
    a Prometheus histogram exports. Filled by the engine thread; `snapshot` is what crosses."""

    bounds: tuple[float, ...]
    counts: list[int] = attrs.field(init=False)
    total: float = 0.0
    count: int = 0

    def __attrs_post_init__(self) -> None:
        self.counts = [0] * len(self.bounds)

    def observe(self, value: float) -> None:
        for i, bound in enumerate(self.bounds):
            if value <= bound:
                self.counts[i] += 1
        self.total += value
        self.count += 1

    def snapshot(self) -> Histogram:
        out = Histogram(self.bounds)
        out.counts, out.total, out.count = list(self.counts), self.total, self.count
        return out


@attrs.frozen
class HostCacheStats:
    hits: int
    """Admissions that restored pages from the host store."""
    reused_tokens: int
    """Tokens those pages covered beyond the page pool's hit."""
    memory_records: int
    disk_records: int
    parked_records: int
    bytes_out: int
    bytes_in: int
    held: dict[str, int]
    """Records taken in, by tier (dram, nvme)."""
    dropped: dict[tuple[str, str], int]
    """Records dropped, by (tier, reason): end_of_chain (budget), oversize, io_error."""
    skipped: int
    missing_tokens: Histogram | None = None
    """Per host-store lookup (an admission with the host store present): prompt tokens left to
    prefill after the page pool's and the host store's hits."""
    transfer_ns: Histogram | None = None
    """Per lookup: the time to bring its host-store pages into the page pool (measured)."""
    prefill_ns: Histogram | None = None
    """Per lookup: its missing tokens times the engine's recent prefill time per token (an estimate)."""


@attrs.frozen
class CheckpointStats:
    """State checkpoints of a layout with recurrent layers (`engine/kv/checkpoints.py`)."""

    captures: dict[str, int]
    """Snapshots captured, by role: anchor, message, endpoint."""
    skips: dict[str, int]
    """Captures rejected, by reason: unknown_cost, work_budget, storage."""
    extra_work_ns: int
    """Charged predicted extra work of the captures (copies, split steps), ns: not a timing."""
    anchor_reservations: int
    """Anchor captures selected for running requests and not taken yet."""
    restores: int
    """Admissions that continued from a checkpoint."""
    host_restores: int
    """Of those, the ones whose snapshot came from the host store."""
    snapshots: int
    """Registered snapshots in the pool now."""
    slots: int
    """Snapshot rows of the pool."""


@attrs.frozen
class RankStats:
    """One data-parallel rank as the front end sees it (`engine/dp.py`)."""

    rank: int
    up: bool
    """Its process is running and ready (False while it is down or restarting)."""
    in_flight: int
    """Children routed to it that have not finished."""
    routed: int
    """Children routed to it since the server started."""
    routed_hit_tokens: int
    """Prompt tokens the router found in its cached pages when it routed them (predicted hits)."""
    reused_tokens: int
    """Prompt tokens its engine reused from its prefix cache (its own count, since its last start)."""
    restarts: int
    cached_pages: int
    """Pages the router's mirror of its prefix cache holds (from its KV events)."""
    pid: int = 0
    """Its process id (0 while none runs)."""


@attrs.frozen
class EngineStats:
    active: int
    pending: int
    free_pages: int
    total_pages: int
    page_tokens: int
    prefill_tokens: int
    generated_tokens: int
    decode_weight_bytes: int = 0
    """Bytes of weights one decode step reads for one request (0: the model declares none)."""
    prefix_caching: bool = False
    reused_tokens: int = 0
    """Prompt tokens covered by page-pool prefix hits at admission (first admissions)."""
    cached_pages: int = 0
    """Registered full pages (held or evictable)."""
    host: HostCacheStats | None = None
    """The host store behind the prefix cache; None when there is none."""
    reasoning_budget_cuts: int = 0
    """Requests whose reasoning the engine closed at their hard token budget (a forced close)."""
    speculative_mode: str = "off"
    """``[speculative] mode``: off, ngram or adaptive."""
    history_drafts: bool = False
    """Speculating requests also draft from the shared decoded history (flare_history_drafts_enabled)."""
    speculative: SpeculativeStats | None = None
    """Speculation counters (verification rounds and drafts; engine/speculative.py)."""
    threads: ThreadStats | None = None
    """The engine thread's intra-op team (engine/threads.py); None for a core run without one."""
    checkpoints: CheckpointStats | None = None
    """State checkpoints; None unless the layout has recurrent layers and the prefix cache is on."""
    learned_drafter: bool = False
    """A draft model drafts for the speculating requests (``[speculative] draft_model``)."""
    draft_steps: int = 0
    """Draft positions the draft model ran (prefill and decode positions; engine/drafter.py)."""
    data_parallel: tuple[RankStats, ...] = ()
    """Per rank, with data parallelism (`engine/dp.py`); empty for one engine."""
