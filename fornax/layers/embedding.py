"""Token embeddings read from the model file's own bytes, one row per looked-up token.

Why: the embedding table is the largest single weight of a small model (SmolLM2-135M: 49,152
x 576, 54 MiB in bf16), yet a step reads only one row per token. When nothing else needs the
table dense (the LM head has its own quantized forms, or is a separate tensor), the rows stay
in the memory-mapped GGUF and are converted as they are looked up: only the pages of tokens
actually seen become resident, and those are file pages the kernel can drop and re-read.

Each row is converted exactly as the loader converts the whole table (the file's values to
float32, then to the model's dtype), so the result is bit for bit what the dense table gave
(tests/model/test_memory.py). Q8_0, F16, BF16 and F32 rows are converted with torch
ops (tens of microseconds per step); other types through layers/dequantize.py.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch
from gguf import GGMLQuantizationType
from torch import nn

from fornax.layers.dequantize import dequantize

Q8_0_BLOCK_BYTES = 34  # a float16 scale, then 32 int8 values


class FileEmbedding(nn.Module):
    """nn.Embedding's forward over rows kept in a GGUF tensor's raw bytes ([vocab, row_bytes])."""

    def __init__(
        self, rows: np.ndarray, qtype: GGMLQuantizationType, hidden: int, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.qtype, self.hidden, self.dtype = qtype, hidden, dtype
        self._numpy_rows = rows  # for layers/dequantize.py (types without a torch path here)
        with warnings.catch_warnings():  # the map is read-only, and nothing here writes to it
            warnings.simplefilter("ignore", UserWarning)
            self.raw = torch.from_numpy(rows.view(np.uint8).reshape(rows.shape[0], -1))

    def __deepcopy__(self, memo: dict) -> FileEmbedding:
        return self  # read-only file bytes: a copy (the self-draft model's) would only duplicate them

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = self.raw[input_ids.reshape(-1)]  # [N, row_bytes] uint8
        n = rows.shape[0]
        kind = self.qtype.name
        if kind == "Q8_0":
            blocks = rows.view(n, -1, Q8_0_BLOCK_BYTES)
            scale = blocks[..., :2].contiguous().view(torch.float16).float()  # [N, blocks, 1]
            values = blocks[..., 2:].view(torch.int8).float()  # [N, blocks, 32]
            out = (values * scale).view(n, self.hidden)
        elif kind == "F32":
            out = rows.view(torch.float32)
        elif kind == "F16":
            out = rows.view(torch.float16).float()
        elif kind == "BF16":
            out = rows.view(torch.bfloat16).float()
        else:
            out = dequantize(self._numpy_rows[input_ids.reshape(-1).numpy()], self.qtype, torch.float32)
        return out.to(self.dtype).view(*input_ids.shape, self.hidden)
