"""What the native kernels run on this CPU, said in one line, and the activation dtype that
suits it (docs/kernels.md).

`describe` reads the forms a loaded model's Linears actually hold (not what was asked for),
so the line cannot claim a kernel that did not load: the start-up log, `/v1/models` and
`fornax memory` print it, e.g. `kernels: avx2+fma; decode int4, large steps int8 x int8,
attention bf16`.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable

import torch

from fornax.layers import isa
from fornax.layers.linear import (
    AmxBf16,
    BlockInt4,
    BlockInt8,
    DenseBf16,
    DenseF32,
    Int4Grouped,
    Int8PerChannel,
    Int8Rotated,
    Linear,
)
from fornax.layers.native import library_level

logger = logging.getLogger("fornax.kernels")

# A form's name in the line; torch's kernels are named as such, so a slow path is visible.
FORM_NAMES: dict[type, str] = {
    BlockInt4: "int4",
    BlockInt8: "int8",
    DenseBf16: "bf16",
    DenseF32: "f32",
    AmxBf16: "bf16 (amx)",
    Int8Rotated: "int8 x int8",
    Int4Grouped: "int4 (torch)",
    Int8PerChannel: "int8 (torch)",
}
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float32: "f32", torch.float16: "f16"}


def step_forms(linear: Linear) -> tuple[str, str]:
    """(the form of a one-row step, the form of a large step) for one Linear."""
    dense = f"{DTYPE_NAMES.get(linear.weight.dtype, '?')} (torch)" if linear.weight is not None else "none"

    def form_for(rows: int) -> str:
        if linear.small is not None and rows <= linear.small_max_rows:
            return FORM_NAMES.get(type(linear.small), type(linear.small).__name__)
        if linear.large is not None and rows >= linear.large_min_rows:
            return FORM_NAMES[Int8Rotated]
        if linear.mid is not None and rows <= linear.mid_max_rows:
            return FORM_NAMES[DenseBf16]
        return dense

    return form_for(1), form_for(512)


def _most_common(names: Iterable[str]) -> str:
    counts = Counter(names).most_common()
    return "/".join(name for name, _ in counts) if counts else "none"


def describe(linears: Iterable[Linear], attention: str) -> str:
    """The one line: the level, the decoder's forms for decode and for large steps (several,
    most common first, where layers differ), and the attention kernel's dtype (or "torch")."""
    pairs = [step_forms(linear) for linear in linears]
    decode = _most_common(small for small, _ in pairs)
    large = _most_common(big for _, big in pairs)
    return f"kernels: {isa_summary()}; decode {decode}, large steps {large}, attention {attention}"


def isa_summary() -> str:
    """The level the loaded library was built for (layers/isa.py), or "none" where none loaded."""
    choice = library_level()
    if choice is None:
        return "none (torch ops)"
    return choice.level.summary if choice.level is not None else "scalar"


# CPU flags under which torch computes bf16 matmuls natively (oneDNN's AVX-512 BF16 / AMX paths).
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


def choose_dtype(kernels_loaded: bool, flags: frozenset[str]) -> str:
    """dtype "auto": bfloat16 where fornax's kernels run (they widen bf16 to float32 in registers,
    at every level) or where the CPU multiplies bf16 itself; else float32, since torch would
    emulate every bf16 matmul (on an AVX2 CPU a 16-prompt batch ran ~3x slower in bf16 than in
    float32, 2026-12-06)."""
    return "bfloat16" if kernels_loaded or flags & NATIVE_BF16_FLAGS else "float32"


def resolve_dtype(kernel_backend: str) -> str:
    """choose_dtype for this process, saying once why where it picks float32."""
    loaded = kernel_backend == "native" and library_level() is not None
    dtype = choose_dtype(loaded, isa.cpu_flags())
    if dtype == "float32":
        why = "kernel_backend torch" if kernel_backend != "native" else "no native kernels"
        logger.warning(
            "dtype auto -> float32 (%s, and this CPU has no native bf16: bf16 would be emulated, "
            "several times slower); activations and K/V then take twice bf16's memory",
            why,
        )
    return dtype
