"""Tensor parallelism, Megatron-style: one model's layers split across ranks of a
torch.distributed process group (gloo: fornax runs on CPUs; NCCL is for a GPU path, not built).

Each rank holds a slice of every decoder layer: a contiguous range of KV heads with the query
heads of their groups (QKV column-parallel, O row-parallel), and a contiguous range of the MLP's
intermediate channels (gate/up column-parallel, down row-parallel). The row-parallel outputs are
partial sums, completed by one all-reduce after the attention and one after the MLP. The
embedding, the norms and the LM head are replicated, so every rank ends a step with the full
hidden states and the same logits. A rank's model is the ordinary model class built with its
slice's sizes (`ShardPlan.local_config`), so the kernels, the paged KV cache (a rank holds its
KV heads only) and the weight forms are those of a single process.

Mixture-of-experts layers (models/moe.py) split by expert instead: each rank holds a
contiguous range of whole experts (and a range of the shared expert's channels, as a dense
MLP's), every rank routes every token with the whole router, runs the experts it holds on the
tokens that chose them, and the block's output, a partial sum, is completed by the same one
all-reduce per layer. A rank reads nothing of the experts it does not hold.

Deterministic mode uses another layout for O and down (Shard.exact): split by output channel,
each over its whole input gathered from the ranks, so that every value is computed as one
process computes it and the ranks give one process's bits.

Heads are split by KV group, never inside one where it can be avoided: with at least as many
KV heads as ranks, ranks take whole groups (unevenly when the count does not divide: the
default model's 3 KV heads over 2 ranks are 2 + 1 groups); with fewer, each KV head is
replicated on world / num_kv_heads ranks, which split its group's query heads.

This module is the model half of docs/tensor-parallel.md; the engine half (one scheduler,
worker processes running each step) is fornax/engine/tensor_parallel.py.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any
from urllib.parse import urlparse

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from fornax.config import ModelConfig
from fornax.layers.linear import Linear
from fornax.models.moe import SparseMoE, expert_names, shared_expert_names

AllReduce = Callable[[torch.Tensor], None]  # a sum (or max) of a tensor across the ranks, in place
QUANT_BLOCK = 32  # the values per scale of the int4/int8 forms and of GGUF's Q4_0/Q8_0 blocks


# Concatenates each rank's [T, n_r] along the last dimension, in rank order: (tensor, [n_r]).
AllGather = Callable[[torch.Tensor, list[int]], torch.Tensor]


@dataclass(frozen=True)
class Shard:
    """What load_model needs to build one rank's slice: which rank of how many, and the
    collectives its layers call: a sum after each row-parallel projection; a maximum that gives
    the w8a8 form's per-row scales the whole row's range (layers/linear.py Int8Rotated); and,
    in the exact layout, a gather.

    exact (deterministic mode): O and down are split by output channel instead of input, and
    each takes the whole input, gathered from the ranks; their outputs are gathered too. Every
    output value is then computed over its whole row by the kernels one process runs, in the
    same order, so the ranks give one process's bits, at two gathers per projection instead of
    one sum (docs/tensor-parallel.md)."""

    rank: int
    world: int
    all_reduce: AllReduce
    all_reduce_max: AllReduce
    all_gather: AllGather | None = None
    exact: bool = False


@dataclass(frozen=True)
class ShardPlan:
    """What one rank holds: global index ranges of query heads, KV heads and MLP channels."""

    rank: int
    world: int
    q_heads: range
    kv_heads: range
    intermediate: range
    hidden: range  # the output channels of O and down in the exact layout (Shard.exact)
    experts: range = range(0)  # a mixture-of-experts model's experts held here
    shared: range = range(0)  # and its shared expert's channels

    def local_config(self, config: ModelConfig) -> ModelConfig:
        """The model config of this rank's slice (head_dim and hidden size unchanged)."""
        moe = config.moe
        if moe is not None:
            local = (self.experts.start, self.experts.stop)
            moe = replace(moe, local_experts=local, shared_expert_intermediate_size=len(self.shared))
        return replace(
            config,
            num_attention_heads=len(self.q_heads),
            num_key_value_heads=len(self.kv_heads),
            intermediate_size=len(self.intermediate),
            moe=moe,
        )


def _even_ranges(n: int, parts: int) -> list[range]:
    bounds = [int(b[0]) for b in np.array_split(np.arange(n), parts) if len(b)] + [n]
    return [range(a, b) for a, b in itertools.pairwise(bounds)]


def plan_shards(config: ModelConfig, world: int) -> list[ShardPlan]:
    """One ShardPlan per rank; ValueError when the heads cannot be split over `world` ranks."""
    heads, kv_heads, inter = config.num_attention_heads, config.num_key_value_heads, config.intermediate_size
    group = heads // kv_heads
    if world < 1:
        raise ValueError(f"tensor parallel size must be >= 1, got {world}")
    moe = config.moe
    if world > 1 and moe is not None and moe.num_experts < world:
        raise ValueError(f"{moe.num_experts} experts cannot be split over {world} ranks")
    if world > 1 and config.qk_norm_whole:  # OLMoE: an RMS over every head, which no rank holds
        raise ValueError("Q/K norms over the whole projection (OLMoE) are not split over ranks yet")
    if world > 1 and config.fused_projections:  # Phi-3: the cuts name q/k/v and gate/up apart
        raise ValueError("fused Q/K/V and gate/up tensors (Phi-3) are not split over ranks yet")
    if world > inter:
        raise ValueError(f"tensor parallel size {world} exceeds the MLP width {inter}")
    if kv_heads >= world:
        kv_ranges = _even_ranges(kv_heads, world)
        q_ranges = [range(r.start * group, r.stop * group) for r in kv_ranges]
    else:
        per_head = world // kv_heads  # ranks sharing one KV head
        if world % kv_heads or group % per_head:
            raise ValueError(
                f"{kv_heads} KV heads of {group} query heads each cannot be split over {world} ranks: "
                "the size must divide into the KV heads, or each KV head's queries into the ranks sharing it"
            )
        kv_ranges = [range(r // per_head, r // per_head + 1) for r in range(world)]
        share = group // per_head
        q_ranges = [
            range(kv.start * group + (r % per_head) * share, kv.start * group + (r % per_head + 1) * share)
            for r, kv in enumerate(kv_ranges)
        ]
    mlp = _channel_ranges(inter, world)
    hidden = _even_ranges(config.hidden_size, world)
    experts = _even_ranges(moe.num_experts, world) if moe is not None else [range(0)] * world
    shared_width = moe.shared_expert_intermediate_size if moe is not None else 0
    shared = _channel_ranges(shared_width, world) if shared_width else [range(0)] * world
    return [
        ShardPlan(r, world, q_ranges[r], kv_ranges[r], mlp[r], hidden[r], experts[r], shared[r])
        for r in range(world)
    ]


def _channel_ranges(width: int, world: int) -> list[range]:
    """An MLP's channels over the ranks, in whole 32-value quantization blocks where the width
    allows: a rank's columns of down then hold exactly the blocks the whole matrix would."""
    unit = QUANT_BLOCK if width % QUANT_BLOCK == 0 and width // QUANT_BLOCK >= world else 1
    return [range(r.start * unit, r.stop * unit) for r in _even_ranges(width // unit, world)]


# What one rank reads of a tensor: (axis, start, stop), rows (0) or columns (1) [start, stop).
Cut = tuple[int, int, int]
NOT_HELD: Cut = (0, 0, 0)  # none of it: an expert another rank holds


def shard_cuts(config: ModelConfig, plan: ShardPlan, exact: bool = False) -> dict[str, Cut]:
    """The HF-named tensors a rank holds a part of, and which part: its heads' rows of q/k/v (and
    their biases), its heads' columns of o, its channels' rows of gate/up and columns of down
    (exact: o's and down's rows of the rank's hidden channels instead). Every other tensor is
    whole on every rank. The loaders read only these parts from the memory-mapped file where
    its blocks allow (models/loader.py)."""
    d = config.head_dim
    q, kv, mlp, out = plan.q_heads, plan.kv_heads, plan.intermediate, plan.hidden
    cuts: dict[str, Cut] = {}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        for name, heads in (("q", q), ("k", kv), ("v", kv)):
            for kind in ("weight", "bias"):
                cuts[f"{p}self_attn.{name}_proj.{kind}"] = (0, heads.start * d, heads.stop * d)
        cuts[f"{p}self_attn.o_proj.weight"] = (1, q.start * d, q.stop * d)
        cuts[f"{p}mlp.gate_proj.weight"] = cuts[f"{p}mlp.up_proj.weight"] = (0, mlp.start, mlp.stop)
        cuts[f"{p}mlp.down_proj.weight"] = (1, mlp.start, mlp.stop)
        if exact:
            cuts[f"{p}self_attn.o_proj.weight"] = cuts[f"{p}mlp.down_proj.weight"] = (0, out.start, out.stop)
        if config.moe is not None and i in config.moe.sparse_layers:
            if exact:
                raise ValueError("deterministic tensor parallelism does not split experts yet")
            for e in range(config.moe.num_experts):
                if e not in plan.experts:
                    cuts.update(dict.fromkeys(expert_names(config.moe, i, e), NOT_HELD))
            if config.moe.shared_expert_intermediate_size:
                gate, up, down, _ = shared_expert_names(i)
                cuts[gate] = cuts[up] = (0, plan.shared.start, plan.shared.stop)
                cuts[down] = (1, plan.shared.start, plan.shared.stop)
    return cuts


def take_cut(t: Any, cut: Cut) -> Any:
    """`cut` of a torch tensor or numpy array (a view)."""
    axis, start, stop = cut
    return t[start:stop] if axis == 0 else t[:, start:stop]


def row_parallel_linears(model: nn.Module) -> list[Linear]:
    """The projections whose rows each rank holds a part of (their outputs are partial sums):
    attention O and MLP down, or a sparse layer's shared-expert down."""
    found = []
    for layer in model.layers:
        found.append(layer.self_attn.o_proj)
        mlp = layer.mlp
        if not isinstance(mlp, SparseMoE):
            found.append(mlp.down_proj)
        elif mlp.shared_expert is not None:
            found.append(mlp.shared_expert.down_proj)
    return found


def install_all_reduce(model: nn.Module, all_reduce: AllReduce) -> None:
    """Complete each partial-sum output with `all_reduce` (a forward hook, so the model code
    stays the single-process one; the one-call native step bypasses hooks and must not run):
    attention O's and each MLP's, a sparse layer's after the whole block (its experts' and
    shared expert's parts)."""

    def hook(_module: nn.Module, _inputs: object, output: torch.Tensor) -> torch.Tensor:
        all_reduce(output)
        return output

    for layer in model.layers:
        mlp = layer.mlp
        for module in (layer.self_attn.o_proj, mlp if isinstance(mlp, SparseMoE) else mlp.down_proj):
            module.register_forward_hook(hook)


def split_row_layers_by_output(
    model: nn.Module, config: ModelConfig, plan: ShardPlan, dtype: torch.dtype
) -> None:
    """The exact layout (Shard.exact): O and down as Linears over the whole input and the rank's
    hidden channels, in place of the input-split ones the model class built (before loading)."""
    d, width = config.head_dim, len(plan.hidden)
    for layer in model.layers:
        layer.self_attn.o_proj = Linear(config.num_attention_heads * d, width, False, dtype)
        layer.mlp.down_proj = Linear(config.intermediate_size, width, False, dtype)


def install_gathers(model: nn.Module, config: ModelConfig, world: int, all_gather: AllGather) -> None:
    """The exact layout's collectives: each O / down gathers its input (every rank's heads or
    channels, in order) before it runs and its output (every rank's hidden channels) after."""
    plans = plan_shards(config, world)
    head_widths = [len(p.q_heads) * config.head_dim for p in plans]
    channel_widths = [len(p.intermediate) for p in plans]
    hidden_widths = [len(p.hidden) for p in plans]

    def gather_input(widths: list[int]) -> Callable[[nn.Module, tuple[torch.Tensor]], tuple[torch.Tensor]]:
        return lambda _module, args: (all_gather(args[0], widths),)

    def gather_output(_module: nn.Module, _inputs: object, output: torch.Tensor) -> torch.Tensor:
        return all_gather(output, hidden_widths)

    for layer in model.layers:
        for linear, widths in ((layer.self_attn.o_proj, head_widths), (layer.mlp.down_proj, channel_widths)):
            linear.register_forward_pre_hook(gather_input(widths))
            linear.register_forward_hook(gather_output)


# How long a rank waits for rank 0's next message: an idle engine sends none, so this is no
# failure bound (a rank that dies closes its connections, which every wait sees at once).
IDLE_WAIT = timedelta(days=365)
# How long the ranks may take to meet at start-up: a spawned worker imports torch and fornax
# first, which took over 3 s on 2 busy cores, so the (often seconds-long) step timeout cannot
# bound it. Rank 0 sees a local worker that dies before joining at once (engine/tensor_parallel.py).
JOIN_TIMEOUT = timedelta(minutes=5)


def connect_gloo_groups(
    init_method: str, rank: int, world: int, timeout_s: float
) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """Two gloo groups of their own over the same ranks, met at `init_method` (tcp://host:port;
    rank 0 listens there), not torch.distributed's default group (several engines may live in
    one process): one for a step's collectives, each of which gives up after `timeout_s`
    seconds (the meeting itself is bounded by JOIN_TIMEOUT), and one that only carries rank
    0's next-message header, on which the workers wait as long as the engine stays idle."""
    url = urlparse(init_method)
    if url.scheme != "tcp" or not url.hostname or not url.port:
        raise ValueError(f"distributed init must be tcp://host:port, got {init_method!r}")
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(url.hostname, url.port, world, rank == 0, max(timeout, JOIN_TIMEOUT))
    # each group keeps its (prefixed view of the) store alive
    steps = dist.ProcessGroupGloo(dist.PrefixStore("steps", store), rank, world, timeout)
    waiting = dist.ProcessGroupGloo(dist.PrefixStore("waiting", store), rank, world, IDLE_WAIT)
    return steps, waiting


def gloo_all_reduce(group: dist.ProcessGroup) -> AllReduce:
    """A sum over `group`, in place."""

    def all_reduce(t: torch.Tensor) -> None:
        group.allreduce(t).wait()

    return all_reduce


def gloo_all_gather(group: dist.ProcessGroup) -> AllGather:
    """Each rank's [T, n_r] concatenated in rank order along the last dimension (gloo's gather
    takes equal sizes: each part is padded to the widest and cut back)."""

    def all_gather(t: torch.Tensor, widths: list[int]) -> torch.Tensor:
        widest = max(widths)
        if t.shape[-1] < widest:
            t = torch.nn.functional.pad(t, (0, widest - t.shape[-1]))
        parts = [torch.empty_like(t) for _ in widths]
        group.allgather([parts], [t.contiguous()]).wait()
        return torch.cat([part[..., :w] for part, w in zip(parts, widths)], dim=-1)

    return all_gather


def gloo_all_reduce_max(group: dist.ProcessGroup) -> AllReduce:
    """An element-wise maximum over `group`, in place (exact, so in any order)."""
    options = dist.AllreduceOptions()
    options.reduceOp = dist.ReduceOp.MAX

    def all_reduce_max(t: torch.Tensor) -> None:
        group.allreduce([t], options).wait()

    return all_reduce_max


def gloo_shard(group: dist.ProcessGroup, rank: int, exact: bool = False) -> Shard:
    """Rank `rank`'s Shard over `group` (exact: deterministic mode's layout, Shard.exact)."""
    return Shard(
        rank, group.size(), gloo_all_reduce(group), gloo_all_reduce_max(group), gloo_all_gather(group), exact
    )
