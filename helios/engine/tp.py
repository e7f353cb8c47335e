"""Tensor parallelism in the engine: rank 0 runs the whole engine, the other ranks run their model
shard's forward passes as rank 0's runner makes them (docs/architecture.md, "Tensor and expert
parallelism").

Rank 0 owns the scheduler, the KV manager (page ownership, prefix cache), the persistent input
batch and the sampler, exactly as with one rank; its model is a `TensorParallelLeader` over its own
shard. Each call the runner makes of the model is broadcast first (`broadcast_object_list`, a
pickled record: a forward's token ids, positions, the step's `AttentionInputs` with its block
tables and slot mappings, the image rows and the kept rows; a logits call's hidden rows), then run
on rank 0's shard; the workers (`serve_worker`) receive the same record and run the same call on
theirs, so every rank meets the same collectives in the same order (the all-reduces inside the
layers, the vocabulary all-gather of `compute_logits`). Each rank has its own KV pool, of its own
KV heads, with the same page ids: block tables built on rank 0 index every rank's pool, and a page
the prefix cache shares holds the same positions on every rank. Sampling is rank 0's alone (the
workers' gathered logits are dropped).

What the workers never see: host-store copies and restores of pages and recurrent-state snapshots
(rank 0's pool only), so `helios.runtime` refuses a host store with tensor parallelism, and only
families without recurrent layers shard (`models.tp.TP_ARCHITECTURES`). A draft model drafts on
rank 0 alone, unsharded.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from typing import Any

import attrs
import torch
import torch.distributed as dist
from torch import Tensor

from helios.engine.attention import AttentionInputs, TorchPagedBackend
from helios.engine.kv.layout import CacheLayout
from helios.models.interface import AttentionContext, CacheSpec, CausalLM
from helios.models.tp import ParallelContext

__all__ = ["RankLost", "TensorParallelLeader", "WorkerSetup", "serve_worker"]

log = logging.getLogger("helios.engine.tp")

_FORWARD, _LOGITS, _STOP = "forward", "logits", "stop"


@attrs.frozen
class WorkerSetup:
    """What a worker needs to build its KV pool as rank 0 built its own (rank 0 sends it first)."""

    num_pages: int
    page_size: int
    kv_dtype: str
    num_state_slots: int
    max_active: int = 0
    step_tokens: int = 0
    """What sizes a lazy row-window pool (`EngineCore.step_tokens`; 0: none is lazy)."""


class RankLost(BaseException):
    """A collective of a step failed (a rank died, its connection closed): the group can run no
    further step, so this ends the engine thread (a BaseException passes its per-step containment)
    and the server takes its engine-death path: /health 503, in-flight requests fail in their
    protocol's shape, `helios serve` drains and exits 70 for its supervisor to restart it."""


@contextlib.contextmanager
def _fatal_across_ranks() -> Iterator[None]:
    """Any failure of a broadcast call becomes `RankLost`: the workers may be inside its collectives."""
    try:
        yield
    except Exception as exc:
        raise RankLost(f"tensor parallel: a step failed across the ranks ({type(exc).__name__}: {exc})") from exc


class TensorParallelLeader:
    """Rank 0's `CausalLM`: its shard, with every forward and logits call broadcast to the workers
    before it runs (see the module docstring)."""

    def __init__(self, model: CausalLM, ctx: ParallelContext) -> None:
        if ctx.rank != 0:
            raise ValueError(f"the leader is rank 0, not rank {ctx.rank}")
        self.model = model
        self.ctx = ctx
        self._stopped = False

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    def cache_specs(self) -> Sequence[CacheSpec]:
        return self.model.cache_specs()

    def decode_weight_bytes(self) -> int:
        return self.model.decode_weight_bytes()

    def start_workers(self, setup: WorkerSetup) -> None:
        """Tell the workers how to build their KV pools (once, before the first step)."""
        _broadcast(self.ctx, setup)

    def __call__(self, input_ids: Tensor, positions: Tensor, ctx: AttentionContext, *,
                 embeds: tuple[Tensor, Tensor] | None = None, keep: Tensor | None = None) -> Tensor:
        inputs = getattr(ctx, "inputs", None)
        if not isinstance(inputs, AttentionInputs):
            raise TypeError(f"tensor parallelism needs the paged backend's attention context, got {type(ctx).__name__}")
        with _fatal_across_ranks():
            _broadcast(self.ctx, _host((_FORWARD, input_ids, positions, inputs, embeds, keep)))
            return self.model(input_ids, positions, ctx, embeds=embeds, keep=keep)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        with _fatal_across_ranks():
            _broadcast(self.ctx, _host((_LOGITS, hidden)))
            return self.model.compute_logits(hidden)

    def stop_workers(self) -> None:
        """End the workers' loops (idempotent); after the engine's last step."""
        if not self._stopped:
            self._stopped = True
            _broadcast(self.ctx, (_STOP,))


def serve_worker(model: CausalLM, ctx: ParallelContext, dtype: torch.dtype, device: torch.device) -> int:
    """A worker rank's loop: build the KV pool rank 0 describes, then run each broadcast call on
    this rank's shard until rank 0 stops the workers. Returns the number of forward calls run."""
    if ctx.rank == 0:
        raise ValueError("rank 0 leads; serve_worker runs on the other ranks")
    setup = _broadcast(ctx)
    if not isinstance(setup, WorkerSetup):
        raise RuntimeError(f"tensor-parallel worker {ctx.rank}: expected the KV setup first, got {setup!r}")
    layout = CacheLayout.from_specs(model.cache_specs())
    backend = TorchPagedBackend.for_layout(layout, setup.num_pages, setup.page_size, dtype, device,
                                           num_state_slots=setup.num_state_slots, kv_dtype=setup.kv_dtype,
                                           max_active=setup.max_active, step_tokens=setup.step_tokens)
    log.info("tensor-parallel rank %d/%d: KV pool of %d pages", ctx.rank, ctx.world_size, setup.num_pages)
    forwards = 0
    with torch.inference_mode():
        while True:
            message = _device(_broadcast(ctx), device)
            kind = message[0]
            if kind == _FORWARD:
                _, input_ids, positions, inputs, embeds, keep = message
                model(input_ids, positions, backend.build(inputs), embeds=embeds, keep=keep)
                forwards += 1
            elif kind == _LOGITS:
                model.compute_logits(message[1])
            elif kind == _STOP:
                return forwards
            else:
                raise RuntimeError(f"tensor-parallel worker {ctx.rank}: unknown message {kind!r}")


def _broadcast(ctx: ParallelContext, obj: Any = None) -> Any:
    """Rank 0's ``obj`` on every rank (pickled; NCCL carries the bytes on the rank's CUDA device)."""
    box = [obj]
    device = ctx.device if ctx.device.type == "cuda" else None
    dist.broadcast_object_list(box, src=0, group=ctx.group, device=device)
    return box[0]


def _host(obj: Any) -> Any:
    """``obj`` with its tensors as compact CPU copies (a pickled CUDA tensor would name rank 0's
    device, and a pickled view carries its whole storage)."""
    return _map(obj, lambda t: t.detach().to("cpu", copy=True))


def _device(obj: Any, device: torch.device) -> Any:
    return _map(obj, lambda t: t.to(device))


def _map(obj: Any, fn: Any) -> Any:
    if isinstance(obj, Tensor):
        return fn(obj)
    if isinstance(obj, tuple):
        return tuple(_map(o, fn) for o in obj)
    if isinstance(obj, list):
        return [_map(o, fn) for o in obj]
    if isinstance(obj, AttentionInputs):
        return attrs.evolve(obj, **{f.name: _map(getattr(obj, f.name), fn) for f in attrs.fields(AttentionInputs)})
    return obj
