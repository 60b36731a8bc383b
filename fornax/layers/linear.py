"""Linear layers: one dense weight, plus optional forms for small, mid and large steps.

On a CPU the best matmul kernel depends on how many rows a step carries: with a few rows
(decode), weight-only int4/int8 kernels read 2-4x fewer bytes than bf16; with many (prefill,
batches), int8 weights times int8 activations compute about twice as fast as bf16 (measured:
docs/kernels.md). So a Linear holds up to three forms and `forward` picks one by the row
count of its input. Which forms, and for which row counts, is not decided here:
layers/kernel_plan.py's plan_linear chooses them from the kernels that run, the file's
quantization and the flags, and `build_forms` builds what it names.

The forms are small classes (docs/architecture.md, rule 8), not branches inside the hot loop:
BlockInt4 / BlockInt8 run fornax's integer kernel (kernels/quant_matmul.c, at every native
level); they are also what the one-call small step (models/native_step.py) reads. DenseBf16
and DenseF32 run the Linear's own weight (no copy) through the native dense kernels, AmxBf16
holds it on AMX tiles, Int8Rotated rotates both sides blockwise and rounds them to int8
(kernels/int8_matmul.c). Int4Grouped / Int8PerChannel are torch's kernels, for processes
without the native ones.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, Protocol, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from fornax.layers import kernel_plan as kp
from fornax.layers.kernel_plan import LinearPlan
from fornax.layers.lora import LoRASlots
from fornax.layers.native import (
    AmxBf16Matmul,
    Bf16Matmul,
    F32Matmul,
    Int8Matmul,
    QuantMatmul,
    load_amx_bf16_matmul,
    load_bf16_matmul,
    load_f32_matmul,
    load_int8_matmul,
    load_quant_matmul,
)

T = TypeVar("T")

# Turns per-row maxima over a slice of each row into maxima over the whole rows, in place.
RowMax = Callable[[torch.Tensor], None]


class LinearMethod(Protocol):
    """A way to compute x W^T for a fixed W."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


class Int8PerChannel:
    """Weight-only int8, symmetric per output channel; activations stay bf16."""

    quantized = True

    def __init__(self, weight: torch.Tensor) -> None:
        w = weight.float()
        scale = w.abs().amax(dim=1).clamp(min=1e-8) / 127.0  # [out]
        self.qweight = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)  # [out, in]
        self.scale = scale.to(torch.bfloat16)

    def dequantize(self) -> torch.Tensor:
        return self.qweight.float() * self.scale.float()[:, None]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.bfloat16:  # the common case: skip two no-op casts (~2 us each per call)
            return torch._weight_int8pack_mm(x, self.qweight, self.scale)
        return torch._weight_int8pack_mm(x.to(torch.bfloat16), self.qweight, self.scale).to(x.dtype)


def _asymmetric_int4(
    weight: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round to 16 levels spanning each group's range: w ~ q * scale + lo, q [out, in] in [0, 15]
    (uint8), scale and lo [out, groups] float32."""
    out_f, in_f = weight.shape
    w = weight.float().view(out_f, in_f // group_size, group_size)
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)
    scale = ((hi - lo) / 15.0).clamp(min=1e-8)
    q = torch.round((w - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.uint8)
    return q.view(out_f, in_f), scale, lo


class Int4Grouped:
    """Weight-only int4, asymmetric per group of `group_size` input channels.

    torch's packed layout computes w = (q - 8) * scale + zero with q in [0, 15].
    """

    quantized = True

    def __init__(self, weight: torch.Tensor, group_size: int = 32) -> None:
        _out_f, in_f = weight.shape
        if in_f % group_size:
            raise ValueError(f"in_features {in_f} is not a multiple of the int4 group size {group_size}")
        q, scale, lo = _asymmetric_int4(weight, group_size)
        self.init_packed(q.to(torch.int32), scale, lo + 8.0 * scale, group_size)

    @classmethod
    def from_blocks(
        cls, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int
    ) -> Int4Grouped:
        """From a quantization done elsewhere (a GGUF file's Q4 blocks): q [out, in] in [0, 15],
        w = (q - 8) * scale + zero per group. The scales are stored in bf16, as the kernel reads them."""
        self = cls.__new__(cls)
        self.init_packed(q.to(torch.int32), scale.float(), zero.float(), group_size)
        return self

    def init_packed(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int) -> None:
        """q: [out, in] int32 in [0, 15]; scale, zero: [out, groups]."""
        self.group_size = group_size
        self.packed = torch._convert_weight_to_int4pack_for_cpu(q.contiguous(), 1)
        # [groups, out, 2] bf16, the layout the kernel reads
        self.scale_zero = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
        self._q = q  # kept only for dequantize() in tests; small next to the dense weight

    def dequantize(self) -> torch.Tensor:
        out_f, in_f = self._q.shape
        sz = self.scale_zero.float().transpose(0, 1)  # [out, groups, 2]
        q = self._q.float().view(out_f, in_f // self.group_size, self.group_size)
        return ((q - 8.0) * sz[..., 0:1] + sz[..., 1:2]).view(out_f, in_f)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.bfloat16:  # the common case: skip two no-op casts (~2 us each per call)
            return torch._weight_int4pack_mm_for_cpu(x, self.packed, self.group_size, self.scale_zero)
        y = torch._weight_int4pack_mm_for_cpu(
            x.to(torch.bfloat16), self.packed, self.group_size, self.scale_zero
        )
        return y.to(x.dtype)


TILE_ROWS = 4  # kernels/quant_matmul.c ROW_BLOCK: rows stored together, pair by pair


def _tile_rows(t: torch.Tensor, pair_width: int) -> torch.Tensor:
    """[N, K'] -> the kernel's tile order [N / 4, pairs, 4, pair_width] (N padded with zero rows):
    each tile's rows are read as one forward stream (see kernels/quant_matmul.c)."""
    n, width = t.shape
    pad = -n % TILE_ROWS
    if pad:
        t = torch.cat([t, t.new_zeros(pad, width)])
    tiles = t.view(-1, TILE_ROWS, width // pair_width, pair_width)
    return tiles.transpose(1, 2).contiguous()


def _untile_rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of _tile_rows: [N, K'] without the padding rows."""
    tiles, pairs, rows, pair_width = t.shape
    return t.transpose(1, 2).reshape(tiles * rows, pairs * pair_width)[:n]


class BlockInt4:
    """Weight-only int4 in blocks of 32, w = d * q + m (llama.cpp's Q4_1), for the native
    integer kernel (kernels/quant_matmul.c: activations rounded to int8 per 4 values, exact
    integer dot products). Scales in float16, as the GGUF blocks carry them."""

    quantized = True

    def __init__(self, weight: torch.Tensor, kernel: QuantMatmul) -> None:
        self._init(*_asymmetric_int4(weight, 32), kernel)

    @classmethod
    def from_blocks(
        cls, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, kernel: QuantMatmul
    ) -> BlockInt4:
        """From Int4Blocks' form (w = (q - 8) * scale + zero, group 32): d = scale, m = zero - 8 * scale."""
        self = cls.__new__(cls)
        self._init(q.to(torch.uint8), scale.float(), zero.float() - 8.0 * scale.float(), kernel)
        return self

    def _init(self, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, kernel: QuantMatmul) -> None:
        out_f, in_f = q.shape
        pairs = q.view(out_f, in_f // 64, 2, 32)  # two blocks share each byte (see the kernel)
        packed = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(out_f, in_f // 2)
        self.out_features, self.kernel = out_f, kernel
        self.packed = _tile_rows(packed, 32)
        self.d = _tile_rows(d.half(), 2)
        self.m = torch.cat([m.half(), m.new_zeros(-out_f % TILE_ROWS, m.shape[1]).half()]).contiguous()

    def dequantize(self) -> torch.Tensor:
        packed = _untile_rows(self.packed, self.out_features)
        out_f, half = packed.shape
        pairs = packed.view(out_f, half // 32, 1, 32)
        q = torch.cat([pairs & 0x0F, pairs >> 4], dim=2).reshape(out_f, half // 16, 32).float()
        d = _untile_rows(self.d, out_f).float()[..., None]
        return (q * d + self.m[:out_f].float()[..., None]).view(out_f, half * 2)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel("q4", x, self.packed, self.d, self.m, self.out_features)


class BlockInt8:
    """Weight-only int8, symmetric per block of 32 (llama.cpp's Q8_0), for the native integer
    kernel; finer than per-channel int8 at the same kernel cost."""

    quantized = True

    def __init__(self, weight: torch.Tensor, kernel: QuantMatmul) -> None:
        out_f, in_f = weight.shape
        w = weight.float().view(out_f, in_f // 32, 32)
        d = (w.abs().amax(dim=-1) / 127.0).clamp(min=1e-8)
        q = torch.round(w / d[..., None]).clamp(-127, 127).to(torch.int8).view(out_f, in_f)
        self.out_features, self.kernel = out_f, kernel
        self.qweight, self.d = _tile_rows(q, 64), _tile_rows(d.half(), 2)

    def dequantize(self) -> torch.Tensor:
        out_f = self.out_features
        q = _untile_rows(self.qweight, out_f).float()
        in_f = q.shape[1]
        d = _untile_rows(self.d, out_f).float()
        return (q.view(out_f, in_f // 32, 32) * d[..., None]).view(out_f, in_f)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel("q8", x, self.qweight, self.d, None, self.out_features)


class DenseBf16:
    """The dense bf16 weight itself, through the native bf16 kernel (kernels/bf16_matmul.c):
    the small-step form of bf16 Linears without a quantized one, and the mid tier past the
    quantized form's limit of those with one. Holds the Linear's weight tensor, so it costs
    no memory."""

    quantized = False

    def __init__(self, weight: torch.Tensor, kernel: Bf16Matmul) -> None:
        self.weight, self.kernel = weight, kernel

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(x, self.weight)


class DenseF32:
    """The dense float32 weight itself through kernels/f32_matmul.c: every step's form in
    float32 layers (faster than torch's at decode sizes, and batch-invariant where torch's
    float32 linear blocks its sums by the call's shape). Holds the Linear's weight tensor, so
    it costs no memory."""

    quantized = False

    def __init__(self, weight: torch.Tensor, kernel: F32Matmul) -> None:
        self.weight, self.kernel = weight, kernel

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(x, self.weight)


class AmxBf16:
    """The dense bf16 weight repacked into AMX tiles (kernels/amx_matmul.c): deterministic
    mode's form for dense bf16 layers where the CPU has AMX. Its sums for a row are the same
    whatever rows share the call, and past a few rows it runs at oneDNN's speed, where
    DenseBf16's AVX-512 loop falls to a fraction of it (docs/deterministic.md). Replaces the
    dense weight (same bytes, up to 31 zero channels of padding)."""

    quantized = False

    def __init__(self, weight: torch.Tensor, kernel: AmxBf16Matmul) -> None:
        out_f, in_f = weight.shape
        pad = -out_f % 32  # the kernel's panels of two 16-channel blocks
        w = torch.cat([weight, weight.new_zeros(pad, in_f)]) if pad else weight
        # [N / 16, 16 ch, K / 32, 16 pairs, 2] -> [N / 16, K / 32, 16 pairs, 16 ch, 2]: each block of
        # 16 channels x 32 values is one B tile, row p holding the channels' values 2p, 2p + 1
        tiles = w.reshape(-1, 16, in_f // 32, 16, 2).permute(0, 2, 3, 1, 4)
        self.packed = tiles.contiguous().to(torch.bfloat16)
        self.out_features, self.kernel = out_f, kernel

    def dequantize(self) -> torch.Tensor:
        """The weight [out, in] (unpacked; no rounding was involved)."""
        blocks, ksteps = self.packed.shape[:2]
        w = self.packed.permute(0, 3, 1, 2, 4).reshape(blocks * 16, ksteps * 32)
        return w[: self.out_features]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(x, self.packed, self.out_features)


def hadamard_blocks(w: torch.Tensor, block: int = 32) -> torch.Tensor:
    """Each row's blocks of `block` values times the unnormalized Sylvester Hadamard matrix
    (entries +-1; what kernels/int8_matmul.c applies to activations), in float32."""
    h = torch.ones(1, 1)
    while h.shape[0] < block:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    rows, width = w.shape
    return (w.float().view(rows, width // block, block) @ h).view(rows, width)


class Int8Rotated:
    """int8 weights and int8 activations: x W^T = (x H)(W H)^T / 32 for H the blockwise
    Hadamard transform, with W H rounded to int8 per output channel (once, here) and x H per
    row (each call), multiplied in exact int32 sums by kernels/int8_matmul.c (AVX-512 VNNI).
    For the steps past the small-step form's limit, where it is ~2x the bf16 kernels' speed
    here; why the rotation: see int8_matmul.c."""

    quantized = True

    def __init__(self, weight: torch.Tensor, kernel: Int8Matmul, whole_row_max: RowMax | None = None) -> None:
        """whole_row_max: the weight's columns (and each input row) are one tensor-parallel
        rank's slice of longer rows (models/sharding.py); it turns a per-row maximum
        over the slice into one over the whole row, in place (a max across the ranks), so the
        slice is rounded with the scales one process would use."""
        self.whole_row_max = whole_row_max
        w = hadamard_blocks(weight)  # [out, in], = 32 * (W H) for the orthonormal H
        wmax = w.abs().amax(dim=1)  # [out]
        if whole_row_max is not None:
            whole_row_max(wmax)
        wmax = wmax.clamp(min=1e-30)
        q = torch.round(w * (127.0 / wmax)[:, None]).to(torch.int8)  # [out, in]
        out_f, in_f = q.shape
        pad = -out_f % 64  # the kernel's panels of 64 output channels, padded with zero channels
        q = torch.cat([q, q.new_zeros(pad, in_f)]) if pad else q
        self.out_features, self.kernel = out_f, kernel
        self.packed = (
            q.view(-1, 64, in_f // 4, 4).transpose(1, 2).contiguous()
        )  # [out_pad / 64, in / 4, 64, 4]
        self.colsum = q.sum(dim=1, dtype=torch.int32)  # [out_pad]
        self.scale = torch.cat([wmax / (127.0 * 32.0), wmax.new_zeros(pad)]).contiguous()  # float32 [out_pad]

    def int8_weight(self) -> torch.Tensor:
        """The rotated int8 weight, [out, in] (the panels unpacked)."""
        panels, quads = self.packed.shape[:2]
        return self.packed.transpose(1, 2).reshape(panels * 64, quads * 4)[: self.out_features]

    def dequantize(self) -> torch.Tensor:
        """W as this form holds it (the rotation undone), [out, in] float32."""
        w_rot = self.int8_weight().float() * (self.scale[: self.out_features] * 32.0)[:, None]
        return hadamard_blocks(w_rot) / 32.0  # H H = 32 I

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.whole_row_max is None:
            return self.kernel(x, self.packed, self.colsum, self.scale, self.out_features)
        row_max = self.kernel.rotated_row_max(x)
        self.whole_row_max(row_max)
        return self.kernel(x, self.packed, self.colsum, self.scale, self.out_features, given_max=row_max)


SMALL_STEP_METHODS: dict[str, type] = {"int8": Int8PerChannel, "int4": Int4Grouped}


class Int4FileBlocks(NamedTuple):
    """A GGUF's own Q4 blocks for one Linear (its tensors' rows concatenated): q [out, in] in
    [0, 15], w = (q - 8) * scale + zero per group of group_size values."""

    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    group_size: int


def _kernel(load: Callable[[], T | None], form: str) -> T:
    kernel = load()
    if kernel is None:  # the plan was made for kernels this process did not load
        raise RuntimeError(f"the {form} form was planned, but its native kernel did not load")
    return kernel


class Linear(nn.Module):
    """y = x W^T (+ b). Weights are set by the model's loader, never trained."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        # None once the plan finds that its forms serve every row count (build_forms).
        dense = torch.empty(out_features, in_features, dtype=dtype)
        self.weight: nn.Parameter | None = nn.Parameter(dense, requires_grad=False)
        self.bias = (
            nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False) if bias else None
        )
        self.small: LinearMethod | None = None
        self.small_max_rows = 0
        # A second tier past the quantized one: the native bf16 kernel on the dense weight, for
        # steps above small_max_rows and up to mid_max_rows, where it still beats oneDNN.
        self.mid: DenseBf16 | None = None
        self.mid_max_rows = 0
        # Steps of at least large_min_rows rows (and past the small form's limit): int8 x int8.
        self.large: Int8Rotated | None = None
        self.large_min_rows = 0
        # What build_forms built, as plan_linear chose it; until then the dense weight alone.
        self.plan = LinearPlan(dense_name=kp.dense_form_name(dtype))
        # Adapters' low-rank products, added on top of whichever form ran (layers/lora.py).
        self.lora: LoRASlots | None = None

    def shape(self, **file: object) -> kp.LinearShape:
        """This Linear as plan_linear sees it; `file`: LinearShape's fields on the file's tensors."""
        return kp.LinearShape(self.in_features, self._dense().dtype, **file)

    def _dense(self) -> torch.Tensor:
        if self.weight is None:
            raise RuntimeError("the dense weight was released: no form can be built from it")
        return self.weight.data

    def build_forms(
        self,
        plan: LinearPlan,
        file_blocks: Int4FileBlocks | None = None,
        whole_row_max: RowMax | None = None,
    ) -> None:
        """Build the forms `plan` names (layers/kernel_plan.py: plan_linear chose them) from the
        dense weight, or from the file's own Q4 blocks where the plan says so, and drop the dense
        weight where no step reads it. whole_row_max: this Linear's input is a slice of a longer
        row (Int8Rotated)."""
        self.small = self._make(plan.small, plan.small_from_file, file_blocks, whole_row_max)
        self.mid = self._make(plan.mid, False, None, None)
        self.large = self._make(plan.large, False, None, whole_row_max)
        self.small_max_rows = plan.small_max_rows if self.small is not None else 0
        self.mid_max_rows = plan.mid_max_rows if self.mid is not None else 0
        self.large_min_rows = plan.large_min_rows if self.large is not None else 0
        self.plan = plan
        if not plan.keep_dense:
            self.weight = None

    def _make(
        self,
        form: str | None,
        from_file: bool,
        blocks: Int4FileBlocks | None,
        whole_row_max: RowMax | None,
    ) -> LinearMethod | None:
        if form is None:
            return None
        if from_file:
            if blocks is None:
                raise ValueError(f"the {form} form is planned from the file's blocks, and none were given")
            if form == kp.INT4:
                return BlockInt4.from_blocks(
                    blocks.q, blocks.scale, blocks.zero, _kernel(load_quant_matmul, form)
                )
            return Int4Grouped.from_blocks(blocks.q, blocks.scale, blocks.zero, blocks.group_size)
        w = self._dense()
        if form == kp.INT4:
            return BlockInt4(w, _kernel(load_quant_matmul, form))
        if form == kp.INT8:
            return BlockInt8(w, _kernel(load_quant_matmul, form))
        if form == kp.INT4_TORCH:
            return Int4Grouped(w)
        if form == kp.INT8_TORCH:
            return Int8PerChannel(w)
        if form == kp.BF16:
            return DenseBf16(w, _kernel(load_bf16_matmul, form))
        if form == kp.F32:
            return DenseF32(w, _kernel(load_f32_matmul, form))
        if form == kp.AMX_BF16:
            return AmxBf16(w, _kernel(load_amx_bf16_matmul, form))
        if form == kp.W8A8:
            return Int8Rotated(w, _kernel(load_int8_matmul, form), whole_row_max)
        raise ValueError(f"no such weight form: {form!r}")

    def configure(self, request: kp.FormRequest, backend: str = "native") -> kp.LinearPlan:
        """Plan and build this Linear's forms alone, with no file behind it (tests, benchmarks)."""
        plan = kp.plan_linear(self.shape(), kp.Kernels.here(backend), request)
        self.build_forms(plan)
        return plan

    def set_small(self, form: LinearMethod, max_rows: int) -> None:
        """A small-step form made elsewhere (a self-draft's own quantization of shared weights,
        engine/spec_decode/self_draft.py); the plan stays the target's."""
        self.small, self.small_max_rows = form, max_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if self.small is not None and rows <= self.small_max_rows:
            y = self.small(x)
        elif self.large is not None and rows >= self.large_min_rows:
            y = self.large(x)
        elif self.mid is not None and rows <= self.mid_max_rows:
            y = self.mid(x)
        else:
            if self.weight is None:  # dropped only where the plan found no row count gets here
                shape = f"{self.in_features}, {self.out_features}"
                raise RuntimeError(f"Linear({shape}): no form serves {rows} rows")
            y = F.linear(x, self.weight, self.bias)
            return y if self.lora is None else self.lora.add_to(x, y)
        if self.bias is not None:
            y = y + self.bias
        return y if self.lora is None else self.lora.add_to(x, y)
