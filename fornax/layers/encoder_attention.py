"""Bidirectional attention within each sequence of a flat batch (encoders: BERT).

An encoder's token attends to every token of its own sequence, before and after it, and to
nothing of the other sequences in the step. No K/V is kept: a sequence is computed whole in
one step (the scheduler never splits an encoder's prompt), so its keys are the step's own.

The step's sequences are laid end to end ([T, ...], as the decoder path gets them); the runner
builds this metadata once per step and every layer reuses it (docs/architecture.md, rule 7):
the rows are gathered into a padded [B, L] grid, attended in one SDPA call with a key mask that
hides the padding, and scattered back. A padded query slot repeats a real row of its sequence, so
its softmax stays finite; its result is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class EncoderMetadata:
    """Where each sequence of a step lies in the flat batch, as a padded grid."""

    query_index: torch.Tensor  # [B, L] flat-batch row of each grid slot (padding: the sequence's first row)
    padded_index: torch.Tensor  # [T] grid slot (row-major in [B * L]) of each flat-batch row
    key_mask: torch.Tensor | None  # [B, 1, 1, L] True where a key is real; None: no padding at all


def build_encoder_metadata(seq_lens: list[int]) -> EncoderMetadata:
    """The grid for sequences of these lengths, laid end to end in the flat batch."""
    lens = np.asarray(seq_lens, dtype=np.int64)
    b, width = len(lens), int(lens.max())
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
    cols = np.arange(width)
    real = cols[None, :] < lens[:, None]  # [B, L]
    query_index = np.where(real, starts[:, None] + cols[None, :], starts[:, None])  # [B, L]
    padded_index = (np.arange(b)[:, None] * width + cols[None, :])[real]  # [T], row-major over the grid
    key_mask = None if real.all() else torch.from_numpy(real)[:, None, None, :]
    return EncoderMetadata(
        query_index=torch.from_numpy(query_index),
        padded_index=torch.from_numpy(padded_index),
        key_mask=key_mask,
    )


def encoder_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, H, D]
    v: torch.Tensor,  # [T, H, D]
    meta: EncoderMetadata,
    scale: float,
) -> torch.Tensor:
    """Each row attends to every row of its own sequence. Returns [T, H, D]."""
    _, h, d = q.shape
    b, width = meta.query_index.shape
    grid = [x[meta.query_index].transpose(1, 2) for x in (q, k, v)]  # each [B, H, L, D]
    out = F.scaled_dot_product_attention(*grid, attn_mask=meta.key_mask, scale=scale)  # [B, H, L, D]
    out = out.transpose(1, 2).reshape(b * width, h, d)  # [B * L, H, D]
    return out[meta.padded_index]  # [T, H, D]
