"""Token embeddings read from the model file's own bytes, one row per looked-up token.

Why: the embedding table is the largest single weight of a small model (SmolLM2-135M: 49,152
x 576, 54 MiB in bf16), yet a step reads only one row per token. When nothing else needs the
table dense (the LM head has its own quantized forms, or is a separate tensor), the rows stay
in the memory-mapped GGUF and are converted as they are looked up: only the pages of tokens
actually seen become resident, and those are file pages the kernel can drop and re-read.

Each row is converted exactly as the loader converts the whole table (layers/dequantize.py:
the file's values to float32, then to the model's dtype), so the result is bit for bit what
the dense table gave (tests/model/test_memory.py).
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType
from torch import nn

from fornax.layers.dequantize import dequantize


class FileEmbedding(nn.Module):
    """nn.Embedding's forward over rows kept in a GGUF tensor's raw bytes ([vocab, row_bytes])."""

    def __init__(
        self, rows: np.ndarray, qtype: GGMLQuantizationType, hidden: int, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.qtype, self.hidden, self.dtype = qtype, hidden, dtype
        self.rows = rows  # [vocab, row]: the file's bytes, typed for F32/F16 (gguf_file.GGUFTensor)

    def __deepcopy__(self, memo: dict) -> FileEmbedding:
        return self  # read-only file bytes: a copy (the self-draft model's) would only duplicate them

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        picked = self.rows[input_ids.reshape(-1).numpy()]  # a copy of the looked-up rows only
        return dequantize(picked, self.qtype, self.dtype).view(*input_ids.shape, self.hidden)
