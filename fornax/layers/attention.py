"""Paged attention over a flattened batch.

The runner lays a step's tokens out flat ([num_tokens, ...]) and builds this metadata once
per step; every layer reuses it. Each layer writes its new K/V into the paged cache
(flat slots = block_id * block_size + offset), then attends in at most three calls:

- short query runs (decodes, speculative verification: at most KERNEL_MAX_QUERIES new
  tokens) and runs of any length over a short context (at most KERNEL_MAX_CONTEXT keys:
  most chat prompts) go to the native kernel, which reads the cache in place
  (layers/native.py);
- without the kernel, decodes form one group: gather K/V, then two batched matmuls;
- prefill chunks form another group on SDPA (plain causal when it is a lone fresh prompt).

So short decode rows are never padded to the length of a long prompt, and no loop over
requests runs inside a layer (docs/architecture.md, rule 7).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from fornax.layers.kv_pool import LayerKV
from fornax.layers.native import PagedAttentionKernel

# Sequences with at most this many new tokens use the native kernel when it is loaded. It
# re-reads the context once per query row, so long chunks belong on SDPA; 16 covers decodes
# and speculative verification.
KERNEL_MAX_QUERIES = 16
# ... and so do runs of any length whose context (cached + new tokens) is at most this long.
# Up to here the kernel's row loop beats SDPA, which for a chunk after a cached prefix (a hit
# on a shared system prompt, a chunked prefill) must also gather the cache and build a mask:
# a fresh prompt prefilled 1.16x faster at 512 tokens, level at 1,024, 0.85x at 2,048; a
# step of 512 tokens of ~190-token chat prompts after a prefix-cache hit, 1.27x
# (--large-step-quantization w8a8, 2026-12-03, ad hoc A/B in one process).
KERNEL_MAX_CONTEXT = 768
# Deterministic mode (docs/deterministic.md): every row goes to the kernel, whatever its length,
# so that a cached prefix and a fresh prompt take one path, and the kernel cuts each row's keys
# into parts of this many, so that a row's sums do not depend on the step's other rows or on the
# thread count. 128 keys: a lone long decode still has parts for both cores.
DETERMINISTIC_PART_KEYS = 128


@dataclass(frozen=True)
class SeqSpan:
    """One sequence in a step: compute positions [start, start + num_new) with this block table."""

    start: int
    num_new: int
    block_ids: list[int]


@dataclass
class AttentionGroup:
    token_index: torch.Tensor  # [T_g] rows of the flat batch that belong to this group
    query_index: torch.Tensor  # [B, Q] flat-batch row of each padded query (padding -> any valid row)
    padded_index: torch.Tensor  # [T_g] position of each real query in the flattened [B * Q]
    kv_slots: torch.Tensor | None  # [B, L] cache slot of each context position; None: no cached context
    mask: torch.Tensor | None  # [B, 1, Q, L] True where a query may attend; None: plain causal
    # Decode groups (one query per sequence): the same mask as an additive float32 bias,
    # [B, 1, 1, L] with -inf where masked, for the explicit two-matmul path below.
    bias: torch.Tensor | None = None


@dataclass
class KernelRows:
    """The flat-batch rows that the native kernel attends, with what it needs to find their keys."""

    kernel: PagedAttentionKernel
    token_index: torch.Tensor | None  # [R] rows of the flat batch; None: every row, in order
    block_tables: torch.Tensor  # [S, max_blocks] int32, one row per sequence in the kernel's rows
    row_seq: torch.Tensor  # [R] int32: which block-table row
    row_pos: torch.Tensor  # [R] int32: the query's position; it attends to keys 0..pos
    block_size: int
    window: int | None
    part_keys: int = 0  # > 0: keys split in fixed parts (deterministic mode); 0: as suits the call


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] cache slot where each new token's K/V is written
    groups: list[AttentionGroup]
    kernel_rows: KernelRows | None = None
    kernel: PagedAttentionKernel | None = None  # also writes int8 K/V rows when loaded
    # A model that interleaves sliding-window layers with full-attention ones (Gemma 3): the
    # same step under the window, for its sliding layers; this metadata serves the others.
    sliding: AttentionMetadata | None = None
    # [num_tokens] each token's sequence length after this step: LongRoPE picks its factors by
    # it, as transformers does per forward call (layers/rotary.py)
    seq_lens: torch.Tensor | None = None


def build_attention_metadata(
    spans: list[SeqSpan],
    block_size: int,
    sliding_window: int | None = None,
    kernel: PagedAttentionKernel | None = None,
    interleaved: bool = False,
    deterministic: bool = False,
) -> AttentionMetadata:
    """Bulk-build slot mapping, the kernel's rows and per-group gather indices and masks for one step.
    interleaved: the window applies only to some layers (ModelConfig.interleaves_sliding_window):
    the result attends over the whole context, and its `sliding` within the window.
    deterministic: every row through the kernel, in fixed parts (DETERMINISTIC_PART_KEYS); it
    needs the kernel."""
    if deterministic and kernel is None:
        raise ValueError("deterministic attention needs the native paged-attention kernel")
    if interleaved and sliding_window is not None:
        full = build_attention_metadata(spans, block_size, None, kernel, deterministic=deterministic)
        full.sliding = build_attention_metadata(
            spans, block_size, sliding_window, kernel, deterministic=deterministic
        )
        return full
    offsets = np.cumsum([0] + [s.num_new for s in spans])
    slot_parts = []
    for s in spans:
        pos = np.arange(s.start, s.start + s.num_new)
        table = np.asarray(s.block_ids, dtype=np.int64)
        slot_parts.append(table[pos // block_size] * block_size + pos % block_size)
    slot_mapping = torch.from_numpy(np.concatenate(slot_parts))
    kernel_rows = None
    if kernel is not None:
        on_kernel = [
            deterministic or s.num_new <= KERNEL_MAX_QUERIES or s.start + s.num_new <= KERNEL_MAX_CONTEXT
            for s in spans
        ]
        short = [i for i, ok in enumerate(on_kernel) if ok]
        if short:
            part_keys = DETERMINISTIC_PART_KEYS if deterministic else 0
            kernel_rows = _build_kernel_rows(
                kernel, spans, short, offsets, block_size, sliding_window, part_keys
            )
        decode, prefill = [], [i for i, ok in enumerate(on_kernel) if not ok]
    else:
        decode = [i for i, s in enumerate(spans) if s.num_new == 1]
        prefill = [i for i, s in enumerate(spans) if s.num_new > 1]
    groups = [
        _build_group(spans, idx, offsets, block_size, sliding_window) for idx in (decode, prefill) if idx
    ]
    seq_lens = torch.from_numpy(np.repeat([s.start + s.num_new for s in spans], [s.num_new for s in spans]))
    return AttentionMetadata(
        slot_mapping=slot_mapping, groups=groups, kernel_rows=kernel_rows, kernel=kernel, seq_lens=seq_lens
    )


def _build_kernel_rows(
    kernel: PagedAttentionKernel,
    spans: list[SeqSpan],
    idx: list[int],
    offsets: np.ndarray,
    block_size: int,
    window: int | None,
    part_keys: int,
) -> KernelRows:
    width = max(len(spans[i].block_ids) for i in idx)
    tables = np.zeros((len(idx), width), dtype=np.int32)
    for r, i in enumerate(idx):
        tables[r, : len(spans[i].block_ids)] = spans[i].block_ids
    counts = [spans[i].num_new for i in idx]
    row_seq = np.repeat(np.arange(len(idx), dtype=np.int32), counts)
    row_pos = np.concatenate([np.arange(spans[i].start, spans[i].start + spans[i].num_new) for i in idx])
    every_row = len(idx) == len(spans)
    token_index = None if every_row else np.concatenate([np.arange(offsets[i], offsets[i + 1]) for i in idx])
    return KernelRows(
        kernel=kernel,
        token_index=None if token_index is None else torch.from_numpy(token_index),
        block_tables=torch.from_numpy(tables),
        row_seq=torch.from_numpy(row_seq),
        row_pos=torch.from_numpy(row_pos.astype(np.int32)),
        block_size=block_size,
        window=window,
        part_keys=part_keys,
    )


def _build_group(
    spans: list[SeqSpan], idx: list[int], offsets: np.ndarray, block_size: int, window: int | None
) -> AttentionGroup:
    q_len = max(spans[i].num_new for i in idx)
    ctx_len = max(spans[i].start + spans[i].num_new for i in idx)
    b = len(idx)
    token_index = np.concatenate([np.arange(offsets[i], offsets[i + 1]) for i in idx])
    query_index = np.zeros((b, q_len), dtype=np.int64) + token_index[0]
    padded_index = np.concatenate([r * q_len + np.arange(spans[i].num_new) for r, i in enumerate(idx)])
    for r, i in enumerate(idx):
        query_index[r, : spans[i].num_new] = np.arange(offsets[i], offsets[i + 1])
    # A lone prompt with no cached context attends only to its own new tokens: plain
    # causal SDPA on the fresh K/V, no gather and no mask (the common first-turn prefill).
    if b == 1 and spans[idx[0]].start == 0 and window is None:
        return AttentionGroup(
            token_index=torch.from_numpy(token_index),
            query_index=torch.from_numpy(query_index),
            padded_index=torch.from_numpy(padded_index),
            kv_slots=None,
            mask=None,
        )
    kv_slots = np.zeros((b, ctx_len), dtype=np.int64)
    q_pos = np.full((b, q_len), -1, dtype=np.int64)
    for r, i in enumerate(idx):
        s = spans[i]
        n = s.start + s.num_new
        pos = np.arange(n)
        table = np.asarray(s.block_ids, dtype=np.int64)
        kv_slots[r, :n] = table[pos // block_size] * block_size + pos % block_size
        q_pos[r, : s.num_new] = np.arange(s.start, n)
    k_pos = np.arange(ctx_len)
    mask = k_pos[None, None, :] <= q_pos[:, :, None]  # [B, Q, L] causal; padding rows see nothing yet
    if window is not None:
        mask &= q_pos[:, :, None] - k_pos[None, None, :] < window
    mask[:, :, 0] |= q_pos < 0  # padding queries attend to one key so softmax stays finite
    mask_t = torch.from_numpy(mask).unsqueeze(1)
    bias = None
    if q_len == 1:
        bias = torch.zeros(mask_t.shape, dtype=torch.float32).masked_fill_(~mask_t, float("-inf"))
    return AttentionGroup(
        token_index=torch.from_numpy(token_index),
        query_index=torch.from_numpy(query_index),
        padded_index=torch.from_numpy(padded_index),
        kv_slots=torch.from_numpy(kv_slots),
        mask=mask_t,
        bias=bias,
    )


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    cache: LayerKV,  # this layer's pools
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Write new K/V into the cache, then attend for every group. Returns [T, H, D]."""
    kernel = meta.kernel
    if not (cache.quantized and kernel is not None and kernel.write_int8(cache, meta.slot_mapping, k, v)):
        cache.write(meta.slot_mapping, k, v)
    if cache.quantized and meta.groups and any(g.kv_slots is None for g in meta.groups):
        # A fresh prompt on SDPA attends to its own new K/V: give it the rows as the cache
        # holds them (int8, dequantized), as every other path reads them, so a prompt's
        # result does not depend on whether it was batched with others.
        k, v = cache.gather(meta.slot_mapping, q.dtype)
    gqa = q.shape[1] != k.shape[1]
    kr = meta.kernel_rows
    if kr is not None and kr.token_index is None:  # every row is short: one kernel call
        return kr.kernel(
            q, cache, kr.block_tables, kr.row_seq, kr.row_pos, kr.block_size, scale, kr.window, kr.part_keys
        )
    if len(meta.groups) == 1 and meta.groups[0].kv_slots is None and kr is None:
        # Single fresh prompt: no padding anywhere, attend over the new tokens directly. The
        # batch dimension matters: given 3-D [H, T, D] inputs, SDPA on CPU takes its math path
        # (materialised scores, safe softmax), ~4x slower at 512 tokens than its flash kernel
        # for [1, H, T, D]; that was ~60% of a 512-token prefill (torch.profiler, 2026-12-03).
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            is_causal=True,
            scale=scale,
            enable_gqa=gqa,
        )  # [1, H, T, D]
        return out[0].transpose(0, 1)
    out = torch.empty_like(q)
    if kr is not None:
        out[kr.token_index] = kr.kernel(
            q[kr.token_index],
            cache,
            kr.block_tables,
            kr.row_seq,
            kr.row_pos,
            kr.block_size,
            scale,
            kr.window,
            kr.part_keys,
        )
    for g in meta.groups:
        b, q_len = g.query_index.shape
        qg = q[g.query_index].transpose(1, 2)  # [B, H, Q, D]
        if g.kv_slots is None:
            kg = k[g.query_index].transpose(1, 2)  # [1, Hkv, Q, D]
            vg = v[g.query_index].transpose(1, 2)
            og = F.scaled_dot_product_attention(qg, kg, vg, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            kg, vg = cache.gather(g.kv_slots, q.dtype)  # [B, L, Hkv, D]; int8 pools dequantized
            kg, vg = kg.transpose(1, 2), vg.transpose(1, 2)  # [B, Hkv, L, D]
            if g.bias is not None:
                og = _decode_attention(qg, kg, vg, g.bias, scale)
            else:
                og = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=g.mask, scale=scale, enable_gqa=gqa)
        og = og.transpose(1, 2).reshape(b * q_len, q.shape[1], q.shape[2])  # [B * Q, H, D]
        out[g.token_index] = og[g.padded_index]
    return out


def _decode_attention(
    q: torch.Tensor,  # [B, H, 1, D]
    k: torch.Tensor,  # [B, Hkv, L, D]
    v: torch.Tensor,  # [B, Hkv, L, D]
    bias: torch.Tensor,  # [B, 1, 1, L] float32, -inf where masked
    scale: float,
) -> torch.Tensor:
    """One query per sequence as two batched matmuls. With a mask, SDPA on this CPU takes its
    slow generic path: 2.6 ms vs 0.2 ms here for 12 sequences at 410 tokens of context.
    The query heads that share a KV head are stacked as rows, so K/V are never repeated."""
    b, h, _, d = q.shape
    hkv = k.shape[1]
    qg = q.reshape(b, hkv, h // hkv, d)  # [B, Hkv, G, D]; heads of one KV group are adjacent
    scores = torch.matmul(qg, k.transpose(-1, -2)).float() * scale + bias  # [B, Hkv, G, L]
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.matmul(probs, v).reshape(b, h, 1, d)  # [B, H, 1, D]
