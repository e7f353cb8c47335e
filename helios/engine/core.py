"""The engine step loop. Runs in its own thread; talks to the async side only through the inbox
(Add / Abort / Shutdown records, thread-safe queue) and the outbox (RequestOutput lists) plus one
`wake()` callback after each step that produced output.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch

from helios.engine.kv.pool import KVCache, PagePool
from helios.engine.records import (
    Abort,
    Add,
    EngineFinish,
    EngineRequest,
    EngineStats,
    InboxItem,
    PromptLogprobRecord,
    RequestOutput,
    Shutdown,
    TokenLogprobRecord,
)
from helios.engine.runner import PagedAttention, build_inputs
from helios.engine.sampler import Sampler, SamplingRow, prompt_scores
from helios.engine.scheduler import ScheduledChunk, Scheduler, SchedulerOutput
from helios.engine.scheduler import Sequence as Seq

log = logging.getLogger("helios.engine")

_SCORE_ROWS = 256  # prompt positions whose logits exist at once while scoring a prompt


@attrs.frozen
class EngineConfig:
    page_size: int = 16
    num_pages: int = 4096
    max_active: int = 64
    prefill_chunk_size: int = 512
    max_model_len: int = 8192


class EngineCore:
    """Owns the model, the KV cache, the scheduler and the sampler. Not thread-safe: one thread runs it."""

    def __init__(self, model: Any, model_config: Any, cfg: EngineConfig, dtype: torch.dtype,
                 device: str | torch.device = "cpu") -> None:
        self.model = model
        self.cfg = cfg
        self.device = torch.device(device)
        self.pool = PagePool(cfg.num_pages, cfg.page_size)
        self.kv = KVCache(model_config.num_layers, cfg.num_pages, cfg.page_size, model_config.num_kv_heads,
                          model_config.head_dim, dtype, self.device)
        self.scheduler = Scheduler(self.pool, max_active=cfg.max_active,
                                   prefill_chunk_size=cfg.prefill_chunk_size, max_model_len=cfg.max_model_len)
        self.sampler = Sampler(model_config.vocab_size, device=self.device)
        self.prefill_tokens = 0
        self.generated_tokens = 0
        self.completed = 0
        self.failed = 0

    # -- inbox handling ---------------------------------------------------------------------
    def add(self, request: EngineRequest) -> None:
        self.scheduler.add(request, Sampler.make_generator(request.sampling.seed))

    def abort(self, request_ids: Sequence[str]) -> list[RequestOutput]:
        return [RequestOutput(s.request_id, (), finish=EngineFinish.ABORTED) for s in self.scheduler.abort(request_ids)]

    # -- the step ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        outputs = [RequestOutput(s.request_id, (), finish=cause, num_prompt_tokens=s.num_prompt_tokens)
                   for s, cause in sched.finished_early]
        if not sched.chunks:
            return outputs
        sampled, scored = self._forward_and_sample(sched)
        self.scheduler.after_forward(sched)
        for c in sched.chunks:
            if c.start < c.seq.num_prompt_tokens:
                self.prefill_tokens += min(c.start + c.length, c.seq.num_prompt_tokens) - c.start
        for c in sched.chunks:
            seq = c.seq
            scores = scored.get(seq.request_id)
            if seq.request_id in sampled:
                token_id, lp = sampled[seq.request_id]
                outputs.append(self._append_token(seq, token_id, lp, scores))
            elif c.samples:
                # A scoring-only request (max_tokens 0): its prefill is done and nothing is sampled.
                self.scheduler.finish(seq)
                self.completed += 1
                outputs.append(RequestOutput(seq.request_id, (), prompt_logprobs=scores, finish=EngineFinish.LENGTH,
                                             num_prompt_tokens=seq.num_prompt_tokens))
            elif scores:
                outputs.append(RequestOutput(seq.request_id, (), prompt_logprobs=scores,
                                             num_prompt_tokens=seq.num_prompt_tokens))
        return outputs

    def _forward_and_sample(
        self, sched: SchedulerOutput
    ) -> tuple[dict[str, tuple[int, TokenLogprobRecord | None]], dict[str, tuple[PromptLogprobRecord | None, ...]]]:
        """Runs the batch; returns the sampled token (and logprobs) per sampling request and the prompt
        scores per prompt-scoring request."""
        input_ids, positions, _ = build_inputs(sched.chunks, self.device)
        attn = PagedAttention(self.kv, sched.chunks, self.cfg.page_size, self.device)
        sample_rows: list[int] = []
        seqs: list[Seq] = []
        scored: dict[str, tuple[PromptLogprobRecord | None, ...]] = {}
        with torch.inference_mode():
            hidden = self.model(input_ids, positions, attn)
            offset = 0
            for c in sched.chunks:
                if c.seq.request.prompt_logprobs is not None and c.start < c.seq.num_prompt_tokens:
                    scores = self._score_prompt_chunk(hidden, offset, c)
                    if scores:
                        scored[c.seq.request_id] = scores
                if c.samples and c.seq.request.max_tokens > 0:
                    sample_rows.append(offset + c.length - 1)
                    seqs.append(c.seq)
                offset += c.length
            if not seqs:
                return {}, scored
            logits = self.model.compute_logits(hidden[sample_rows])
            rows = [
                SamplingRow(
                    params=s.request.sampling,
                    generator=s.generator,
                    prompt_token_ids=s.request.prompt_token_ids,  # the tuple itself, no per-step copy
                    output_token_ids=s.output_token_ids,
                    num_top_logprobs=s.request.num_top_logprobs,
                    logprob_token_ids=s.request.logprob_token_ids,
                )
                for s in seqs
            ]
            token_ids, logprobs = self.sampler.sample(logits, rows)
        sampled: dict[str, tuple[int, TokenLogprobRecord | None]] = {}
        for s, t, lp in zip(seqs, token_ids, logprobs, strict=True):
            rec = None if lp is None else TokenLogprobRecord(lp.token_id, lp.logprob, lp.rank, tuple(lp.top))
            sampled[s.request_id] = (t, rec)
        return sampled, scored

    def _score_prompt_chunk(self, hidden: torch.Tensor, offset: int,
                            chunk: ScheduledChunk) -> tuple[PromptLogprobRecord | None, ...]:
        """Scores of the prompt positions this chunk's rows predict (row p predicts token p + 1).

        Logits exist for at most `_SCORE_ROWS` rows at a time, never for the whole prompt. Positions
        already scored before a preemption are not scored again."""
        seq = chunk.seq
        k = seq.request.prompt_logprobs or 0
        out: list[PromptLogprobRecord | None] = []
        if seq.num_prompt_scored == 0 and chunk.start == 0:
            out.append(None)  # position 0 has nothing before it
            seq.num_prompt_scored = 1
        first = max(chunk.start + 1, seq.num_prompt_scored)
        last = min(chunk.start + chunk.length, seq.num_prompt_tokens - 1)  # inclusive target positions
        vocab_size = self.sampler.vocab_size
        for lo in range(first, last + 1, _SCORE_ROWS):
            hi = min(lo + _SCORE_ROWS, last + 1)
            rows = hidden[offset + lo - 1 - chunk.start : offset + hi - 1 - chunk.start]
            logits = self.model.compute_logits(rows)[:, :vocab_size]
            for score in prompt_scores(logits, seq.token_ids[lo:hi], k):
                out.append(PromptLogprobRecord(score.token_id, score.logprob, score.rank, score.top))
        if last >= first:
            seq.num_prompt_scored = last + 1
        return tuple(out)

    def _append_token(self, seq: Seq, token_id: int, lp: TokenLogprobRecord | None,
                      prompt_logprobs: tuple[PromptLogprobRecord | None, ...] | None = None) -> RequestOutput:
        seq.token_ids.append(token_id)
        self.generated_tokens += 1
        req = seq.request
        finish: EngineFinish | None = None
        if token_id in req.stop_token_ids:
            finish = EngineFinish.STOP_TOKEN
        elif not req.ignore_eos and token_id in req.eos_token_ids:
            finish = EngineFinish.EOS
        elif seq.num_output_tokens >= req.max_tokens or len(seq.token_ids) >= self.cfg.max_model_len:
            finish = EngineFinish.LENGTH
        if finish is not None:
            self.scheduler.finish(seq)
            self.completed += 1
        return RequestOutput(
            seq.request_id,
            (token_id,),
            logprobs=None if lp is None else (lp,),
            prompt_logprobs=prompt_logprobs,
            finish=finish,
            num_prompt_tokens=seq.num_prompt_tokens,
        )

    def stats(self) -> EngineStats:
        return EngineStats(
            active=len(self.scheduler.running),
            pending=len(self.scheduler.waiting),
            free_pages=self.pool.num_free,
            total_pages=self.pool.num_pages,
            page_tokens=self.pool.page_size,
            prefill_tokens=self.prefill_tokens,
            generated_tokens=self.generated_tokens,
            completed=self.completed,
            failed=self.failed,
        )


class EngineThread:
    """Runs an EngineCore in a daemon thread. `submit`/`abort` are thread-safe; outputs go to `sink`.

    `sink(outputs)` is called from the engine thread after every step with output; it must not
    raise and must be cheap (the async side wakes up and drains its own queue).
    """

    def __init__(self, core: EngineCore, sink: Callable[[list[RequestOutput]], None]) -> None:
        self.core = core
        self._sink = sink
        self._inbox: queue.SimpleQueue[InboxItem] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="helios-engine", daemon=True)
        self.healthy = True
        self.error: str | None = None
        self._stats = core.stats()

    def start(self) -> None:
        self._thread.start()

    def submit(self, request: EngineRequest) -> None:
        self._inbox.put(Add(request))

    def abort(self, request_ids: Sequence[str]) -> None:
        self._inbox.put(Abort(tuple(request_ids)))

    def shutdown(self, timeout: float = 10.0) -> None:
        self._inbox.put(Shutdown())
        if self._thread.is_alive():
            self._thread.join(timeout)

    def stats(self) -> EngineStats:
        return self._stats

    def _drain(self, block: bool) -> bool:
        """Apply inbox records; returns False on Shutdown."""
        outputs: list[RequestOutput] = []
        try:
            item: InboxItem | None = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return True
        while item is not None:
            if isinstance(item, Shutdown):
                return False
            if isinstance(item, Add):
                self.core.add(item.request)
            elif isinstance(item, Abort):
                outputs.extend(self.core.abort(item.request_ids))
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                item = None
        if outputs:
            self._sink(outputs)
        return True

    def _run(self) -> None:
        torch.set_grad_enabled(False)
        running = True
        while running:
            try:
                running = self._drain(block=not self.core.scheduler.has_work)
                if not running:
                    break
                if not self.core.scheduler.has_work:
                    self._stats = self.core.stats()
                    continue
                t0 = time.perf_counter()
                outputs = self.core.step()
                self._stats = self.core.stats()
                if outputs:
                    self._sink(outputs)
                log.debug("step %.1f ms, %d outputs", (time.perf_counter() - t0) * 1e3, len(outputs))
            except Exception as exc:  # the engine must report, not die silently
                log.exception("engine step failed")
                self._fail_all(f"engine failure: {exc}")
        self._fail_all("engine shut down")

    def _fail_all(self, message: str) -> None:
        sched = self.core.scheduler
        seqs = list(sched.running) + list(sched.waiting)
        outs = []
        for s in seqs:
            sched.finish(s)
            self.core.failed += 1
            outs.append(RequestOutput(s.request_id, (), finish=EngineFinish.ERROR, error=message))
        if outs:
            self._sink(outs)
