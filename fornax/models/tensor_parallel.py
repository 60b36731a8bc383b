"""Tensor parallelism, Megatron-style: one model's layers split across ranks of a
torch.distributed process group (gloo on CPUs, NCCL on GPUs).

Each rank holds a slice of every decoder layer: a contiguous range of KV heads with the query
heads of their groups (QKV column-parallel, O row-parallel), and a contiguous range of the MLP's
intermediate channels (gate/up column-parallel, down row-parallel). The row-parallel outputs are
partial sums, completed by one all-reduce after the attention and one after the MLP. The
embedding, the norms and the LM head are replicated, so every rank ends a step with the full
hidden states and the same logits. A rank's model is the ordinary model class built with its
slice's sizes (`ShardPlan.local_config`), so the kernels, the paged KV cache (a rank holds its
KV heads only) and the weight forms are those of a single process.

Heads are split by KV group, never inside one where it can be avoided: with at least as many
KV heads as ranks, ranks take whole groups (unevenly when the count does not divide: the
default model's 3 KV heads over 2 ranks are 2 + 1 groups); with fewer, each KV head is
replicated on world / num_kv_heads ranks, which split its group's query heads.

This module is the model half of docs/tensor-parallel.md; the engine half (one scheduler,
worker processes running each step) is not built yet.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import timedelta
from urllib.parse import urlparse

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from fornax.config import ModelConfig
from fornax.layers.linear import Linear

AllReduce = Callable[[torch.Tensor], None]  # sums a tensor across the ranks, in place


@dataclass(frozen=True)
class ShardPlan:
    """What one rank holds: global index ranges of query heads, KV heads and MLP channels."""

    rank: int
    world: int
    q_heads: range
    kv_heads: range
    intermediate: range

    def local_config(self, config: ModelConfig) -> ModelConfig:
        """The model config of this rank's slice (head_dim and hidden size unchanged)."""
        return replace(
            config,
            num_attention_heads=len(self.q_heads),
            num_key_value_heads=len(self.kv_heads),
            intermediate_size=len(self.intermediate),
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
    mlp = _even_ranges(inter, world)
    return [ShardPlan(r, world, q_ranges[r], kv_ranges[r], mlp[r]) for r in range(world)]


def _rows(t: torch.Tensor, index: range, width: int) -> torch.Tensor:
    """Rows [index.start * width, index.stop * width) of t (heads of `width` rows, or channels)."""
    return t[index.start * width : index.stop * width].contiguous()


def shard_tensors(
    tensors: dict[str, torch.Tensor], config: ModelConfig, plan: ShardPlan
) -> dict[str, torch.Tensor]:
    """The HF-named tensors of one rank: its heads' rows of q/k/v (and their biases), its heads'
    columns of o, its channels' rows of gate/up and columns of down; everything else as is."""
    d = config.head_dim
    out = dict(tensors)
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        for name, heads in (("q", plan.q_heads), ("k", plan.kv_heads), ("v", plan.kv_heads)):
            for kind in ("weight", "bias"):
                key = f"{p}self_attn.{name}_proj.{kind}"
                if key in out:
                    out[key] = _rows(out[key], heads, d)
        o = f"{p}self_attn.o_proj.weight"
        out[o] = out[o][:, plan.q_heads.start * d : plan.q_heads.stop * d].contiguous()
        for name in ("gate", "up"):
            key = f"{p}mlp.{name}_proj.weight"
            out[key] = _rows(out[key], plan.intermediate, 1)
        down = f"{p}mlp.down_proj.weight"
        out[down] = out[down][:, plan.intermediate.start : plan.intermediate.stop].contiguous()
    return out


def row_parallel_linears(model: nn.Module) -> list[Linear]:
    """The projections whose outputs are partial sums on each rank: attention O and MLP down."""
    found = []
    for layer in model.layers:  # type: ignore[union-attr]
        found += [layer.self_attn.o_proj, layer.mlp.down_proj]
    return found


def install_all_reduce(model: nn.Module, all_reduce: AllReduce) -> None:
    """Complete each row-parallel output with `all_reduce` (a forward hook, so the model code
    stays the single-process one; the one-call native step bypasses hooks and must not run)."""

    def hook(_module: nn.Module, _inputs: object, output: torch.Tensor) -> torch.Tensor:
        all_reduce(output)
        return output

    for linear in row_parallel_linears(model):
        linear.register_forward_hook(hook)


def build_shard(
    cls: type[nn.Module],
    config: ModelConfig,
    tensors: dict[str, torch.Tensor],
    plan: ShardPlan,
    dtype: torch.dtype,
    all_reduce: AllReduce,
) -> nn.Module:
    """This rank's model: the architecture's class at the slice's sizes, its weights, the all-reduces."""
    model = cls(plan.local_config(config), dtype)
    with torch.no_grad():
        model.load_weights(shard_tensors(tensors, config, plan))
    model.eval()
    install_all_reduce(model, all_reduce)
    return model


def connect_gloo_group(init_method: str, rank: int, world: int, timeout_s: float) -> dist.ProcessGroup:
    """A gloo group of its own, met at `init_method` (tcp://host:port; rank 0 listens there), not
    torch.distributed's default group: several engines may live in one process. Every
    collective on it gives up after `timeout_s` seconds."""
    url = urlparse(init_method)
    if url.scheme != "tcp" or not url.hostname or not url.port:
        raise ValueError(f"distributed init must be tcp://host:port, got {init_method!r}")
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(url.hostname, url.port, world, rank == 0, timeout)
    return dist.ProcessGroupGloo(store, rank, world, timeout)  # it keeps the store alive


def gloo_all_reduce(group: dist.ProcessGroup) -> AllReduce:
    """A sum over `group`, in place."""

    def all_reduce(t: torch.Tensor) -> None:
        group.allreduce(t).wait()

    return all_reduce
