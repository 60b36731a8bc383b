"""The one place that chooses what runs on this CPU (docs/kernels.md): each Linear's weight
form for each step size, the compute dtype, and the one line that says so.

Everything here but `Kernels.here` and `resolve_dtype` is a pure function of its arguments
(which native kernels run, the CPU's flags, a layer's shape and the file's quantization of
it, the flags), so the choices are tested without loading a model. The loader builds what
`plan_linear` returns (Linear.build_forms), and `describe` reads the plans the Linears were
built from: the start-up log, `/v1/models` and `fornax memory` print its line, e.g.
`kernels: avx2+fma; decode int4, large steps int8 x int8, attention bf16`.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

import torch

from fornax.config import SMALL_STEP_MAX_ROWS_W8A8, SMALL_STEP_MAX_ROWS_W8A8_NO_BYTE_DOT
from fornax.layers import isa
from fornax.layers.native import (
    library_level,
    load_amx_bf16_matmul,
    load_bf16_matmul,
    load_f32_matmul,
    load_int8_matmul,
    load_quant_matmul,
)

logger = logging.getLogger("fornax.kernels")

# The weight forms, by the names the summary line prints (layers/linear.py builds each):
INT4 = "int4"  # BlockInt4: the native integer kernel, llama.cpp's Q4_1 blocks
INT8 = "int8"  # BlockInt8: the native integer kernel, Q8_0 blocks
INT4_TORCH = "int4 (torch)"  # Int4Grouped: torch's int4 kernel
INT8_TORCH = "int8 (torch)"  # Int8PerChannel: torch's int8 kernel
BF16 = "bf16"  # DenseBf16: the native bf16 kernel over the dense weight
F32 = "f32"  # DenseF32: the fixed-order float32 kernel over the dense weight
AMX_BF16 = "bf16 (amx)"  # AmxBf16: the dense weight on AMX tiles
W8A8 = "int8 x int8"  # Int8Rotated: int8 weights times int8 activations
NATIVE_INTEGER_FORMS = frozenset({INT4, INT8})

DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float32: "f32", torch.float16: "f16"}


def dense_form_name(dtype: torch.dtype) -> str:
    """The summary's name for torch's linear on a dense weight of `dtype`."""
    return f"{DTYPE_NAMES.get(dtype, '?')} (torch)"


# DenseBf16 serves steps of up to this many rows (or small_max_rows, if larger), in dense
# models and, past the quantized forms' limit, in quantized ones: with the one-call step it
# was ahead of oneDNN at every batch measured up to 64 rows (measured: docs/kernels.md).
DENSE_BF16_MAX_ROWS = 64

# A row limit past any step: the form serves every row count (deterministic mode).
ONE_FORM_ROWS = 1 << 30

# The LM head's int4 form (lm_head_int4) serves steps of at most this many rows: Gemma 3's
# 262k x 640 head, one row 3.1 ms against 6.8 for int8 x int8, two 4.3 against ~7; from four
# rows on the int8 forms win (native int4 vs int8 kernels, 2026-12-05).
LM_HEAD_INT4_MAX_ROWS = 2

# With w8a8 large steps the int4 small-step form serves steps of up to this many rows where the
# int8 x int8 kernel has no byte dot product into int32 (the avx2 and avx512 levels: each 32
# products take vpsignb, vpmaddubsw, vpmaddwd and an add): there the int4 kernel took 0.59-0.83x
# its time at 2 rows and 0.75-0.78x at 4, and about the same at 8 (`FORNAX_ISA=avx2|avx512
# benchmarks/int8_matmul.py`, AMD EPYC Zen 4, 2026-12-07). With VNNI (or NEON's sdot) int8 x int8
# wins from two rows on: config.SMALL_STEP_MAX_ROWS_W8A8.
LEVELS_WITHOUT_BYTE_DOT = frozenset({"avx2", "avx512"})


def w8a8_small_step_rows(level: str | None) -> int:
    """The default small_step_max_rows beside w8a8 large steps, for the kernels' level."""
    return (
        SMALL_STEP_MAX_ROWS_W8A8_NO_BYTE_DOT if level in LEVELS_WITHOUT_BYTE_DOT else SMALL_STEP_MAX_ROWS_W8A8
    )


# CPU flags under which torch computes bf16 matmuls natively (oneDNN's AVX-512 BF16 / AMX paths).
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


@dataclass(frozen=True)
class Kernels:
    """Which native kernels run in this process (layers/native.py builds and loads them)."""

    integer: bool = False  # int4/int8 weights x int8-rounded activations (quant_matmul.c)
    bf16: bool = False  # dense bf16 weights, widened to float32 in registers (bf16_matmul.c)
    f32: bool = False  # dense float32 weights in a fixed order (f32_matmul.c)
    int8: bool = False  # int8 weights x int8 activations (int8_matmul.c)
    amx: bool = False  # dense bf16 weights on AMX tiles (amx_matmul.c)
    # Whether torch's own bf16 matmul is native here (oneDNN on AVX-512 BF16 / AMX); elsewhere it
    # emulates bf16, ~3.3x slower than the native bf16 kernel at every row count measured (AVX2,
    # 16-512 rows, benchmarks/bf16_matmul.py, 2026-12-07), so no bf16 step is left to it.
    torch_bf16: bool = True

    @classmethod
    def here(cls, backend: str) -> Kernels:
        """What loads in this process under `backend` ("torch": none of them)."""
        if backend != "native":
            return cls()
        return cls(
            integer=load_quant_matmul() is not None,
            bf16=load_bf16_matmul() is not None,
            f32=load_f32_matmul() is not None,
            int8=load_int8_matmul() is not None,
            amx=load_amx_bf16_matmul() is not None,
            torch_bf16=bool(isa.usable_flags() & NATIVE_BF16_FLAGS),
        )


@dataclass(frozen=True)
class FormRequest:
    """The flags that bear on the weight forms (EngineConfig's, or a test's)."""

    small_method: str | None = None  # "int8" | "int4" | "auto" (the file's own) | None (dense)
    small_max_rows: int = 0  # 0: no small-step forms at all
    large_method: str | None = None  # "w8a8" | None
    large_min_rows: int = 0
    lm_head_int4: bool = False
    deterministic: bool = False
    keep_dense: bool = False  # a quantized self-draft derives its own forms from the dense weights


@dataclass(frozen=True)
class LinearShape:
    """What the plan needs to know of one Linear and its weights in the file."""

    in_features: int
    dtype: torch.dtype
    # The file's quantization of each tensor fused into it ("int4", "int8", or None: a float
    # tensor), and whether all of them are Q4 blocks the loader kept as they are.
    file_kinds: frozenset[str | None] = frozenset({None})
    file_int4_blocks: bool = False
    is_lm_head: bool = False


@dataclass(frozen=True)
class LinearPlan:
    """A Linear's forms and the rows each serves; a step takes the first tier its rows fit:
    small (up to small_max_rows), large (from large_min_rows), mid (up to mid_max_rows), else
    torch's linear on the dense weight (kept only where some step reads it)."""

    small: str | None = None
    small_max_rows: int = 0
    mid: str | None = None
    mid_max_rows: int = 0
    large: str | None = None
    large_min_rows: int = 0
    small_from_file: bool = False  # the small form is the file's own Q4 blocks, not a requantization
    keep_dense: bool = True
    dense_name: str = "f32 (torch)"
    notes: tuple[str, ...] = field(default=(), compare=False)

    def form_for(self, rows: int) -> str:
        """The form that computes a step of `rows` rows (Linear.forward's order)."""
        if self.small is not None and rows <= self.small_max_rows:
            return self.small
        if self.large is not None and rows >= self.large_min_rows:
            return self.large
        if self.mid is not None and rows <= self.mid_max_rows:
            return self.mid
        return self.dense_name

    def reads_dense(self) -> bool:
        """Whether some step reads the dense weight: a row count that falls through every form
        to torch's linear, or a form that computes from the dense weight itself."""
        if self.small in (BF16, F32) or self.mid in (BF16, F32):
            return True
        if self.small is not None and self.small_max_rows >= ONE_FORM_ROWS:
            return False
        if self.large is None:
            return True
        small = self.small_max_rows if self.small is not None else 0
        covered = max(small, self.mid_max_rows if self.mid is not None else 0)
        return covered + 1 < self.large_min_rows  # rows in (covered, large_min_rows) fall through


class NoBatchInvariantForm(ValueError):
    """Deterministic mode asked for a layer that no batch-invariant form serves here."""


def plan_linear(shape: LinearShape, kernels: Kernels, request: FormRequest) -> LinearPlan:
    """Each step size's form for one Linear. The native forms are chosen wherever they run (they
    beat torch's at the step sizes they serve, docs/kernels.md); torch's int forms where only the
    quantization was asked for; dense weights through torch where nothing else serves."""
    dt = shape.dtype
    integer = kernels.integer and shape.in_features % 64 == 0  # pairs of 32-blocks
    bf16 = kernels.bf16 and dt == torch.bfloat16 and shape.in_features % 32 == 0
    int8 = kernels.int8 and dt == torch.bfloat16 and shape.in_features % 32 == 0
    amx = kernels.amx and dt == torch.bfloat16 and shape.in_features % 32 == 0
    f32 = kernels.f32 and dt == torch.float32 and shape.in_features % 16 == 0
    notes: list[str] = []

    small, small_rows, from_file = None, 0, False
    method, max_rows = request.small_method, request.small_max_rows
    if max_rows > 0 and method == "auto":
        if shape.file_int4_blocks:  # the file's own 4-bit blocks, not rounded a second time
            small, from_file = (INT4 if integer else INT4_TORCH), True
        elif None not in shape.file_kinds:  # quantized in the file in some other form
            method = "int8" if "int8" in shape.file_kinds else "int4"
        else:
            method = None  # a float tensor keeps its dense weight
    if max_rows > 0 and method in ("int4", "int8") and small is None:
        small = {"int4": INT4, "int8": INT8}[method] if integer else f"{method} (torch)"
    if small is not None:
        small_rows = max_rows

    large, large_rows = None, 0
    if request.large_method == "w8a8" and int8:
        large, large_rows = W8A8, request.large_min_rows
        if small == INT8 and large_rows <= 1:
            # Both read int8 weights, and the int8 x int8 kernel was the faster at every row
            # count, one included (measured: docs/kernels.md): the weight-only form would be a
            # second int8 copy of the weights that only costs memory.
            small, small_rows = None, 0

    mid, mid_rows = None, 0
    emulated = bf16 and not kernels.torch_bf16  # torch's bf16 linear would be emulated
    if (max_rows > 0 or emulated) and large is None and bf16:
        # dense bf16 forms: alone, or past the quantized limit; not where int8 x int8 runs
        # (it beats them at every row count, benchmarks/int8_matmul.py). Up to where oneDNN's
        # native bf16 wins, or every row count where torch would emulate bf16.
        rows = ONE_FORM_ROWS if emulated else max(max_rows, DENSE_BF16_MAX_ROWS)
        if small is None:
            small, small_rows = BF16, rows
        elif rows > small_rows:
            mid, mid_rows = BF16, rows

    if max_rows > 0 and large is None and f32:
        # Dense float32 layers take the native loop for every row count: 2.0-2.5x torch's
        # float32 linear (MKL) at 1-4 rows, even at 128, 0.83x at 512 (docs/kernels.md). One
        # form for all rows keeps a float32 model's results independent of what shares a step
        # (MKL's and the loop's sums differ in their last bits, which int8 K/V turned into
        # logprob gaps of 0.04 between a request alone and among 32).
        if small is None:
            small, small_rows = F32, ONE_FORM_ROWS
        elif small_rows < ONE_FORM_ROWS:
            mid, mid_rows = F32, ONE_FORM_ROWS

    if request.lm_head_int4 and shape.is_lm_head:
        if integer:
            small, small_rows, from_file = INT4, LM_HEAD_INT4_MAX_ROWS, False
        else:
            notes.append("the int4 LM head needs the native integer kernels (and a C compiler)")

    if request.deterministic:
        # Which form computes a row must not depend on how many rows share its step
        # (docs/deterministic.md): one batch-invariant form for every row count, the one
        # that holds the weights as configured.
        if large is not None:
            small, small_rows, large_rows = None, 0, 1
        elif small in NATIVE_INTEGER_FORMS:
            small_rows = ONE_FORM_ROWS
        elif amx:
            small, small_rows, from_file = AMX_BF16, ONE_FORM_ROWS, False
        elif small == BF16:
            small_rows = ONE_FORM_ROWS
        elif small in (None, F32) and f32:
            small, small_rows = F32, ONE_FORM_ROWS
        elif small is None and bf16:
            small, small_rows = BF16, ONE_FORM_ROWS
        else:
            form = small or dense_form_name(dt)
            raise NoBatchInvariantForm(
                f"no batch-invariant form runs here for a {form} layer (it needs fornax's native "
                "kernels: a C compiler and AVX2, AVX-512 or NEON)"
            )
        mid, mid_rows = None, 0

    plan = LinearPlan(
        small=small,
        small_max_rows=small_rows,
        mid=mid,
        mid_max_rows=mid_rows,
        large=large,
        large_min_rows=large_rows,
        small_from_file=from_file,
        dense_name=dense_form_name(dt),
        notes=tuple(notes),
    )
    if request.keep_dense or plan.reads_dense():
        return plan
    return replace(plan, keep_dense=False, dense_name="none")  # no step reads it: it is dropped


def _most_common(names: Iterable[str]) -> str:
    counts = Counter(names).most_common()
    return "/".join(name for name, _ in counts) if counts else "none"


def describe(plans: Iterable[LinearPlan], attention: str, level: str | None = None) -> str:
    """The one line: the level, the decoder's forms for decode and for large steps (several,
    most common first, where layers differ), and the attention kernel's dtype (or "torch")."""
    plans = list(plans)
    decode = _most_common(p.form_for(1) for p in plans)
    large = _most_common(p.form_for(512) for p in plans)
    level = isa_summary() if level is None else level
    return f"kernels: {level}; decode {decode}, large steps {large}, attention {attention}"


def isa_summary() -> str:
    """The level the loaded library was built for (layers/isa.py), or "none" where none loaded."""
    choice = library_level()
    if choice is None:
        return "none (torch ops)"
    return choice.level.summary if choice.level is not None else "scalar"


def choose_dtype(kernels_loaded: bool, flags: frozenset[str]) -> str:
    """dtype "auto": bfloat16 where fornax's kernels run (they widen bf16 to float32 in registers,
    at every level) or where the CPU multiplies bf16 itself; else float32, since torch would
    emulate every bf16 matmul (on an AVX2 CPU a 16-prompt batch ran ~3x slower in bf16 than in
    float32, 2026-12-06)."""
    return "bfloat16" if kernels_loaded or flags & NATIVE_BF16_FLAGS else "float32"


def resolve_dtype(kernel_backend: str) -> str:
    """choose_dtype for this process, saying once why where it picks float32."""
    loaded = kernel_backend == "native" and library_level() is not None
    dtype = choose_dtype(loaded, isa.usable_flags())
    if dtype == "float32":
        why = "kernel_backend torch" if kernel_backend != "native" else "no native kernels"
        logger.warning(
            "dtype auto -> float32 (%s, and this CPU has no native bf16: bf16 would be emulated, "
            "several times slower); activations and K/V then take twice bf16's memory",
            why,
        )
    return dtype
