"""Tensor and expert parallelism in the models layer: what one rank of N holds and the collectives
its layers call (docs/architecture.md, "Tensor and expert parallelism").

Megatron's layout over the fused projections of `helios.models.decoder.FusedDecoderLM`:

- column parallel: q/k/v (rank r holds query heads ``r * H/N .. (r + 1) * H/N - 1`` and the same
  slice of the KV heads, their biases too) and gate/up (rank r holds the matching slice of the
  intermediate columns of every MLP: the dense MLP, the shared experts and, without expert
  parallelism, every routed expert);
- row parallel: o_proj and down_proj take the matching input columns; each rank's output is a
  partial sum, which `ParallelContext.all_reduce` sums in place (after o_proj, and after a layer's
  whole feed-forward: routed experts, shared experts and dense MLP are summed in one all-reduce);
- the token embedding is replicated; the output projection is split by vocabulary rows
  (`ParallelContext.vocab_range`: ceil(V / N) rows a rank, the last one shorter), each rank's
  float32 logits are all-gathered (`gather_vocab`), so every logit is one rank's own float32 dot
  product: logprobs come from the whole row, as with one rank.

A rank's model is built from `shard_config` of the checkpoint's config (its heads and intermediate
sizes; everything else unchanged), so the layer code is the single-rank code, and `ShardedWeights`
cuts each Hugging Face tensor to the rank's rows or columns while loading. The one-operator CPU
decode layers (`cpu_kernels.decode_layers`) are not used with N > 1 (they have no all-reduce).

Expert parallelism (``expert_parallel``): the routed experts are split in contiguous blocks of
E / N (rank r holds experts ``r * E/N ..``, each whole); attention and the dense / shared MLPs stay
tensor parallel. In an MoE layer each rank routes its own contiguous share of the step's tokens
(`token_range`; the router weight is replicated, routing is `moe.route`, unchanged), sends each
(token, expert) pair's row to the expert's rank and gets its output back with two
`all_to_all_single` calls (`dispatch_experts`), weights and sums them in the order
`moe.expert_mix` does, and the layer's all-reduce then combines the ranks' token shares with the
shared experts' partial sums (a rank's rows are zero elsewhere, so that sum is exact).

Shards are dense (a dense `WeightFormat`; int4 / int8 formats and kept GGUF blocks are refused by
the model): a float checkpoint's tensors are cut as they are, a GGUF file's quantized tensors
(Q4_0 / Q8_0 codes, K-quant blocks) are dequantized to float32 one at a time and then cut, so a
GGUF checkpoint shards as its dequantized weights. Families: `TP_ARCHITECTURES`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import attrs
import torch
import torch.distributed as dist
from torch import Tensor

from helios.models.quant import BuildSource, dense_of

__all__ = ["TP_ARCHITECTURES", "ParallelContext", "ShardedWeights", "check_divisible", "dispatch_experts",
           "shard_config"]

TP_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe")
"""The registry entries whose modules shard (the llama family and Qwen3-MoE)."""


@attrs.frozen(eq=False)
class ParallelContext:
    """One rank's place in a tensor-parallel group of ``world_size`` processes (an initialised
    `torch.distributed` process group: ``group`` None is the default one). ``expert_parallel``:
    routed experts split across the same ranks. ``device``: where collectives' tensors live (CUDA
    for NCCL)."""

    rank: int
    world_size: int
    group: Any = None
    expert_parallel: bool = False
    device: torch.device = attrs.field(factory=lambda: torch.device("cpu"))

    def __attrs_post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is not in a group of {self.world_size}")

    def all_reduce(self, x: Tensor) -> Tensor:
        """Sum ``x`` over the ranks, in place (every rank gets the same values). A bfloat16 / float16
        ``x`` is summed in float32 and rounded once, as one rank's matmul rounds its float32
        accumulation once (summing the rounded partial sums in bfloat16 would round N times)."""
        if x.dtype in (torch.bfloat16, torch.float16):
            wide = x.float()
            dist.all_reduce(wide, group=self.group)
            return x.copy_(wide)
        dist.all_reduce(x, group=self.group)
        return x

    def span(self, size: int) -> tuple[int, int]:
        """This rank's slice of ``size`` equal parts (``size`` divisible by world_size)."""
        part = size // self.world_size
        return self.rank * part, (self.rank + 1) * part

    def vocab_range(self, vocab: int) -> tuple[int, int, int]:
        """(first row, end row, rows per rank) of this rank's share of the output projection:
        ceil(vocab / N) rows a rank, the last ones shorter (possibly empty)."""
        per = -(-vocab // self.world_size)
        lo = min(vocab, self.rank * per)
        return lo, min(vocab, lo + per), per

    def gather_vocab(self, local: Tensor, vocab: int) -> Tensor:
        """Every rank's float32 logits [N, rows of its share] -> the whole rows [N, vocab]."""
        _, _, per = self.vocab_range(vocab)
        if local.shape[1] < per:
            local = torch.nn.functional.pad(local, (0, per - local.shape[1]))
        parts = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(parts, local.contiguous(), group=self.group)
        return torch.cat(parts, dim=1)[:, :vocab]

    def token_range(self, num_tokens: int) -> tuple[int, int]:
        """The step's tokens this rank routes under expert parallelism: a contiguous share."""
        n = self.world_size
        return self.rank * num_tokens // n, (self.rank + 1) * num_tokens // n

    def expert_range(self, num_experts: int) -> tuple[int, int]:
        """The routed experts this rank holds (all of them without expert parallelism)."""
        return self.span(num_experts) if self.expert_parallel else (0, num_experts)


def check_divisible(config: Any, ctx: ParallelContext) -> None:
    """A clear ValueError when the checkpoint cannot be split over ``ctx.world_size`` ranks: the
    query and KV head counts, the MLP widths and, with expert parallelism, the expert count must
    each be divisible by it."""
    n = ctx.world_size
    heads, kv_heads = config.num_heads, config.num_kv_heads
    if heads % n or kv_heads % n:
        raise ValueError(f"tensor_parallel_size {n} does not divide {heads} query heads / {kv_heads} KV heads "
                         f"(each rank holds whole heads; choose a size that divides both)")
    widths = {"intermediate_size": config.intermediate_size}
    router = getattr(config, "router", None)
    if router is not None:
        if ctx.expert_parallel:
            if router.num_experts % n:
                raise ValueError(f"expert parallelism over {n} ranks does not divide {router.num_experts} experts")
        else:
            widths["moe_intermediate_size"] = config.moe_intermediate_size
        if config.shared_intermediate_size:
            widths["shared_intermediate_size"] = config.shared_intermediate_size
    for name, size in widths.items():
        if size % n:
            raise ValueError(f"tensor_parallel_size {n} does not divide {name} {size}")


def shard_config(config: Any, ctx: ParallelContext) -> Any:
    """The config of one rank's model: its heads and MLP widths (`check_divisible` first)."""
    check_divisible(config, ctx)
    n = ctx.world_size
    changes = {"num_heads": config.num_heads // n, "num_kv_heads": config.num_kv_heads // n,
               "intermediate_size": config.intermediate_size // n}
    if getattr(config, "router", None) is not None:
        if not ctx.expert_parallel:
            changes["moe_intermediate_size"] = config.moe_intermediate_size // n
        changes["shared_intermediate_size"] = config.shared_intermediate_size // n
    return attrs.evolve(config, **changes)


_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


class ShardedWeights(Mapping[str, BuildSource]):
    """``tensors`` (Hugging Face names, read lazily) as one rank loads them: each sharded tensor
    cut to the rank's rows or columns (a copy, so the checkpoint's storage is not kept; a quantized
    source dequantized first), the routed experts of other ranks left out under expert
    parallelism, everything else as it is.
    ``config``: the checkpoint's (unsharded) config."""

    def __init__(self, tensors: Mapping[str, BuildSource], config: Any, ctx: ParallelContext) -> None:
        self._tensors = tensors
        self._ctx = ctx
        self._config = config
        n = ctx.world_size
        q = config.num_heads * config.head_dim // n
        kv = config.num_kv_heads * config.head_dim // n
        r = ctx.rank
        self._q = (r * q, (r + 1) * q)
        self._kv = (r * kv, (r + 1) * kv)
        self._inter = ctx.span(config.intermediate_size)
        router = getattr(config, "router", None)
        self._experts = ctx.expert_range(router.num_experts) if router is not None else (0, 0)
        self._moe_inter = ctx.span(config.moe_intermediate_size) if router is not None else (0, 0)
        shared = getattr(config, "shared_intermediate_size", 0)
        self._shared = ctx.span(shared) if shared else (0, 0)
        self._shared_name = getattr(config, "shared_name", "shared_experts")
        lo, hi, _ = ctx.vocab_range(config.vocab_size)
        self._vocab = (lo, hi)
        self._names = [name for name in tensors if self._rule(name) != "drop"]

    def _rule(self, name: str) -> tuple[int, tuple[int, int]] | str | None:
        """(dimension, (start, end)) to cut, "drop", or None (replicated)."""
        if name == "lm_head.weight" and not self._config.tie_word_embeddings:
            return 0, self._vocab
        match = _LAYER.fullmatch(name)
        if match is None:
            return None
        suffix = match.group(2)
        if suffix.startswith("self_attn."):
            part = suffix.removeprefix("self_attn.")
            if part in ("q_proj.weight", "q_proj.bias"):
                return 0, self._q
            if part in ("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias"):
                return 0, self._kv
            if part == "o_proj.weight":
                return 1, self._q
            return None  # q/k norms: one weight per head dimension, shared by the heads
        expert = _EXPERT.fullmatch(suffix)
        if expert is not None:
            e, proj = int(expert.group(1)), expert.group(2)
            if self._ctx.expert_parallel:
                return None if self._experts[0] <= e < self._experts[1] else "drop"
            return (1 if proj == "down_proj" else 0), self._moe_inter
        for prefix, span in (("mlp.", self._inter), (f"mlp.{self._shared_name}.", self._shared)):
            if suffix in (f"{prefix}gate_proj.weight", f"{prefix}up_proj.weight"):
                return 0, span
            if suffix == f"{prefix}down_proj.weight":
                return 1, span
        return None

    def __getitem__(self, name: str) -> BuildSource:
        rule = self._rule(name)
        if rule == "drop":
            raise KeyError(name)
        value = self._tensors[name]
        if rule is None:
            return value
        assert not isinstance(rule, str)
        dim, (lo, hi) = rule
        dense = value if isinstance(value, Tensor) else dense_of(value)  # GGUF blocks or codes: dequantized
        return dense.narrow(dim, lo, hi - lo).clone()

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


Project = Callable[[Tensor, list[int]], Tensor]
"""Rows grouped by local expert (counts per local expert) -> their expert outputs, same order."""


def dispatch_experts(x: Tensor, weights: Tensor, ids: Tensor, ctx: ParallelContext, num_experts: int,
                     run_local: Project) -> Tensor:
    """Expert parallelism's dispatch and combine for this rank's tokens ``x`` [t, hidden] with their
    routing (``weights``, ``ids`` [t, top_k], global expert ids): returns the weighted sum of each
    token's chosen experts [t, hidden], as `moe.expert_mix` computes it on one rank.

    The (token, slot) pairs are sorted by expert id (stable, as `expert_mix` sorts them); experts
    are in contiguous blocks per rank, so the pairs bound for each rank are one contiguous run. One
    `all_to_all_single` exchanges the run lengths, one the rows and one their expert ids; each rank
    runs its experts on what it received (grouped by local expert, in arrival order: for each expert,
    its rows in the order of the whole step's tokens, as on one rank) and one more all-to-all sends
    the outputs back, which are scaled by their weights and added to their tokens in sorted order."""
    n = ctx.world_size
    per_rank = num_experts // n
    num_tokens, top_k = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    sorted_ids = flat.index_select(0, order)
    token_of = order // top_k
    send_counts = torch.bincount(sorted_ids // per_rank, minlength=n)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=ctx.group)
    sent, received = send_counts.tolist(), recv_counts.tolist()
    rows = x.index_select(0, token_of)
    got_rows = x.new_empty(sum(received), x.shape[1])
    dist.all_to_all_single(got_rows, rows, received, sent, group=ctx.group)
    got_ids = sorted_ids.new_empty(sum(received))
    dist.all_to_all_single(got_ids, sorted_ids, received, sent, group=ctx.group)
    local = got_ids - ctx.rank * per_rank
    by_expert = torch.argsort(local, stable=True)
    counts = torch.bincount(local, minlength=per_rank).tolist()
    outputs = torch.empty_like(got_rows)
    if got_rows.shape[0]:
        outputs[by_expert] = run_local(got_rows.index_select(0, by_expert), counts).to(x.dtype)
    back = x.new_empty(num_tokens * top_k, x.shape[1])
    dist.all_to_all_single(back, outputs, sent, received, group=ctx.group)
    mixed = back * weights.reshape(-1, 1).index_select(0, order)
    return torch.zeros_like(x).index_add_(0, token_of, mixed.to(x.dtype))
