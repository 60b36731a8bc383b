"""The Arm NEON integer matmuls (kernels/quant_matmul_neon.h, kernels/int8_matmul_neon.h),
dense bf16 / float32 matmuls (kernels/bf16_matmul.c, f32_matmul.c on dense_vec.h: dense_neon.h here), fused
elementwise ops (kernels/fused_ops.c on vec128.h) and paged attention
(kernels/paged_attention.c on vec128.h), cross-compiled for AArch64 and run under qemu-user,
against the definitions the x86 tests use.

tests/arm/harness.c drives the kernels with no Python (its header gives the file format); it
is built three times, statically: with the Armv8.2 dot product (sdot), with the int8 matrix
multiply too (smmla, the int8 x int8 product's path where the CPU has it) and for plain
Armv8.0 (the smull fallback); qemu-aarch64-static runs each build over every case at once.
The inputs are packed here by the same classes the x86 kernels are fed by (BlockInt4,
BlockInt8, Int8Rotated: packing needs no kernel), and the outputs are checked as
tests/model/test_quant_matmul.py and tests/model/test_int8_rotated.py check the x86 ones:

- Q4 / Q8: the definition (activations rounded to int8 per 4 values, exact integer sums)
  to float accumulation error, and within 8x bf16's error of the float product.
- int8 x int8: the rounding against torch's transform; the product bit for bit against
  int64 sums of the kernel's own rounding, scaled once and rounded once to bf16. Where the
  x86 kernel runs here (AVX2 or AVX-512), the NEON rounding, scales, row maxima and products
  must equal its output bit for bit: the same transform adds in the same order, the same
  integers, the same float ops.
- fused ops (RMSNorm with and without the residual add, with a float32 weight, rotary,
  SiLU * up; float32 and bf16): against the torch expressions (layers/ops.py's TorchOps) with
  tests/model/test_native_kernels.py's tolerances, and against the x86 library's own output
  bit for bit except where lane order or the exp of a scalar tail differs
  (test_fused_ops_match_the_x86_library says where and by how much). Rows 1, 3, 17 (the
  OpenMP loop), dims 64, 576 and 70 (a scalar tail), strided rows, bf16 rounding ties in the
  residual add, infinities and NaN, and SiLU's gates at exp's clamp and overflow.
- paged attention (float32 and bf16 queries, pools in their type and int8 with row scales):
  against the torch path tests/model/test_native_kernels.py holds the x86 kernel to, with its
  tolerances, and against the x86 kernel's own output on the same inputs within a few float32
  ulps of the largest value (test_paged_attention_matches_the_x86_library says why). Contexts
  of 1, 17, 98-100 and 300 keys in shuffled blocks, GQA groups of 3, no window and a window
  of 32, part_keys 0 (the split by rows, KV heads or keys) and 128 (deterministic mode), 1
  and 2 threads, strided query rows.
- dense bf16 / float32 (deterministic mode's kernels): *_available() is 1; each bf16 output
  within one bf16 ulp of the exact float64 product (tests/model/test_bf16_matmul.py's bound),
  each float32 one within K float32 roundings of it; both bit for bit the AVX2 path's order
  (8 lanes in K order, hsum256's fold), emulated exactly in numpy, and the x86 library's own
  output where it runs that path here; every row's bits the same alone, at other offsets in
  other batches, against slices of the weight rows and at 1 or 2 threads; K not a multiple of
  32 (bf16) / 16 (float32), no rows or no weight rows refused with status 1. Weight rows 5, 7
  and 130 (partial 4-row tiles, 130 over OpenMP's threads), activation rows 1 .. 9 (passes of
  2 and a lone last row), strided rows, K 32 and 96 (bf16), 16 and 48 (float32).

Tile edges: activation rows 1, 2, 3, 5, 17 (the 2-row tiles of Q4/Q8, the 4- and 2-row
register blocks of int8), output widths not a multiple of 4 or of 64, K = 64 .. 1536.
Needs aarch64-linux-gnu-gcc (Debian: gcc-aarch64-linux-gnu, libc6-dev-arm64-cross) and
qemu-aarch64-static (qemu-user-static); skipped without them.
"""

from __future__ import annotations

import functools
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fornax.layers.attention import build_attention_metadata
from fornax.layers.kv_pool import LayerKV
from fornax.layers.linear import BlockInt4, BlockInt8, Int8Rotated, hadamard_blocks
from fornax.layers.native import FusedOps, load_fused_ops, load_int8_matmul, load_paged_attention
from fornax.layers.ops import TorchOps
from fornax.layers.rotary import RotaryEmbedding
from tests.model.test_int8_rotated import _reference_quantize
from tests.model.test_native_kernels import BLOCK, DIM, KV_HEADS, _attend, _pool, _step, _strided_rows
from tests.model.test_native_kernels import HEADS as ATTN_HEADS
from tests.model.test_native_kernels import TOL as FUSED_TOL
from tests.model.test_quant_matmul import _reference as quant_definition

CC = shutil.which("aarch64-linux-gnu-gcc")
QEMU = shutil.which("qemu-aarch64-static")
pytestmark = pytest.mark.skipif(
    CC is None or QEMU is None,
    reason="needs aarch64-linux-gnu-gcc and qemu-aarch64-static "
    "(apt-get install gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user-static)",
)

ROOT = Path(__file__).resolve().parents[2]
KERNELS = ROOT / "fornax" / "layers" / "kernels"
HARNESS = Path(__file__).with_name("harness.c")
# The dot product build, the int8 matrix multiply one (int8 x int8 by smmla) and the plain
# Armv8.0 one (the fallback without sdot).
MARCHES = ["armv8.2-a+dotprod", "armv8.2-a+dotprod+i8mm", "armv8-a"]
OP_Q4, OP_Q8, OP_INT8 = 1, 2, 3
ROWS = [1, 2, 3, 5, 17]
QUANT_SHAPES = [(64, 64), (66, 128), (3, 576), (130, 576)]  # (n, k): n % 4, n % 64 edges
INT8_SHAPES = [(100, 64), (3, 96), (150, 576), (64, 1536)]


@dataclass
class Case:
    name: str
    op: int
    x: torch.Tensor  # [rows, k] (a view into a wider tensor for strided cases)
    form: object
    given_max: torch.Tensor | None = None


def _bits(t: torch.Tensor) -> bytes:
    """Raw little-endian bytes; float16 / bfloat16 as their 16-bit patterns."""
    t = t.contiguous()
    if t.dtype in (torch.float16, torch.bfloat16):
        t = t.view(torch.int16)
    return t.numpy().tobytes()


def _write_case(case: Case, directory: Path, threads: int) -> None:
    directory.mkdir(parents=True)
    rows, k = case.x.shape
    ldx = case.x.stride(0)
    base = case.x.new_zeros(rows, ldx)  # the rows with their stride: the harness reads [rows, ldx]
    base[:, :k] = case.x
    form = case.form
    n = form.out_features
    params = torch.tensor([case.op, rows, k, n, ldx, threads], dtype=torch.int32)
    (directory / "params").write_bytes(_bits(params))
    if case.op in (OP_Q4, OP_Q8):
        (directory / "x.f32").write_bytes(_bits(base.float()))
        (directory / "w.bin").write_bytes(_bits(form.packed if case.op == OP_Q4 else form.qweight))
        (directory / "d.f16").write_bytes(_bits(form.d))
        if case.op == OP_Q4:
            (directory / "m.f16").write_bytes(_bits(form.m))
    else:
        (directory / "x.bf16").write_bytes(_bits(base))
        (directory / "w.bin").write_bytes(_bits(form.packed))
        (directory / "colsum.i32").write_bytes(_bits(form.colsum))
        (directory / "scale.f32").write_bytes(_bits(form.scale))
        if case.given_max is not None:
            (directory / "given_max.f32").write_bytes(_bits(case.given_max))


def _read(path: Path, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    raw = np.frombuffer(path.read_bytes(), dtype=np.uint8).copy()
    return torch.from_numpy(raw).view(dtype).view(shape)


def _cases() -> list[Case]:
    cases = []
    for fmt, op, cls in (("q4", OP_Q4, BlockInt4), ("q8", OP_Q8, BlockInt8)):
        for n, k in QUANT_SHAPES:
            for rows in ROWS:
                gen = torch.Generator().manual_seed(n * 1000 + k + rows)
                form = cls(torch.randn(n, k, generator=gen) * 0.05, None)
                x = torch.randn(rows, k, generator=gen)
                cases.append(Case(f"{fmt}-n{n}-k{k}-r{rows}", op, x, form))
        # rows with a stride, as a view into a fused projection's output
        gen = torch.Generator().manual_seed(1)
        form = cls(torch.randn(100, 192, generator=gen) * 0.05, None)
        wide = torch.randn(4, 300, generator=gen)
        cases.append(Case(f"{fmt}-strided", op, wide[:, 50:242], form))
    for n, k in INT8_SHAPES:
        for rows in ROWS:
            gen = torch.Generator().manual_seed(rows * 100 + n + k)
            form = Int8Rotated((torch.randn(n, k, generator=gen) * 0.05).bfloat16(), None)
            x = torch.randn(rows, k, generator=gen).bfloat16()
            x[:, min(5, k - 1)] *= 40  # an outlier channel, as LLM activations have
            cases.append(Case(f"i8-n{n}-k{k}-r{rows}", OP_INT8, x, form))
    # strided rows with a zero row; and rows rounded against given (larger) maxima
    gen = torch.Generator().manual_seed(1)
    form = Int8Rotated((torch.randn(300, 576, generator=gen) * 0.05).bfloat16(), None)
    wide = torch.randn(9, 2 * 576, generator=gen).bfloat16()
    wide[4] = 0
    cases.append(Case("i8-strided", OP_INT8, wide[:, :576], form))
    x = torch.randn(7, 576, generator=gen).bfloat16()
    given = hadamard_blocks(x).abs().amax(dim=1) * torch.linspace(1.0, 3.0, 7)
    cases.append(Case("i8-given-max", OP_INT8, x, form, given_max=given))
    return cases


CASES = _cases()
CASE_NAMES = [c.name for c in CASES]
BY_NAME = {c.name: c for c in CASES}


# ---- the fused elementwise ops (fused_ops.c on vec128.h) ----

OP_RMS_NORM, OP_RMS_NORM_F32W, OP_ROTARY, OP_SILU_MUL = 4, 6, 8, 10  # the harness adds 1 for bf16
EXT = {torch.float32: "f32", torch.bfloat16: "bf16"}
FUSED_ROWS = [1, 3, 17]  # 17: past PARALLEL_MIN_ROWS, OpenMP's parallel loop
FUSED_DIMS = [64, 576, 70]  # 70: 17 NEON vectors and a scalar tail of 2 (AVX2: 8 and 6)
HEAD_DIM, NUM_HEADS = 64, 3


@dataclass
class FusedCase:
    name: str
    op: int  # OP_*: the float32 form; bf16 when x is
    x: torch.Tensor  # [rows, width], a view with a row stride wider than width
    k: int  # dim / head_dim / inter
    n: int  # dim / num_heads / inter
    weight: torch.Tensor | None = None
    residual: torch.Tensor | None = None  # x's shape and row stride
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None
    eps: float = 1e-5


def _with_stride(t: torch.Tensor) -> torch.Tensor:
    """The rows of a strided view as the harness reads them: [rows, row stride], t at the start."""
    base = t.new_zeros(t.shape[0], t.stride(0))
    base[:, : t.shape[1]] = t
    return base


def _write_fused_case(case: FusedCase, directory: Path, threads: int) -> None:
    directory.mkdir(parents=True)
    bf16 = case.x.dtype == torch.bfloat16
    ext = EXT[case.x.dtype]
    params = [case.op + bf16, case.x.shape[0], case.k, case.n, case.x.stride(0), threads]
    files = {"params": torch.tensor(params, dtype=torch.int32), f"x.{ext}": _with_stride(case.x)}
    if case.op in (OP_RMS_NORM, OP_RMS_NORM_F32W):
        files["eps.f32"] = torch.tensor([case.eps])
        files[f"w.{EXT[case.weight.dtype]}"] = case.weight
    if case.residual is not None:
        assert case.residual.stride(0) == case.x.stride(0)
        files[f"r.{ext}"] = _with_stride(case.residual)
    if case.cos is not None:
        files[f"cos.{ext}"], files[f"sin.{ext}"] = case.cos, case.sin
    for name, t in files.items():
        (directory / name).write_bytes(_bits(t))


def _ties_and_specials(rows: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 x and residual (strided) whose sums are exact ties of bf16 rounding in row 0 (to even:
    down from an even last bit, up from an odd one, both signs), infinities, NaN and overflow to
    inf in row 1, random values after."""
    x, r = _strided_rows(rows, dim, torch.bfloat16, 11), _strided_rows(rows, dim, torch.bfloat16, 12)
    ulp = 2.0**-7  # bf16's step in [1, 2)
    x[0] = torch.tensor([1.0, 1.0 + ulp, -1.0, -1.0 - ulp]).repeat(dim // 4 + 1)[:dim]
    r[0] = torch.tensor([ulp / 2, ulp / 2, -ulp / 2, -ulp / 2]).repeat(dim // 4 + 1)[:dim]
    special = torch.tensor([float("inf"), float("-inf"), float("nan"), 3e38, -3e38, 1.0])
    x[1] = special.repeat(dim // 6 + 1)[:dim]
    r[1] = torch.tensor([1.0, 1.0, 1.0, 3e38, -3e38, 2.0]).repeat(dim // 6 + 1)[:dim]
    return x, r


def _silu_specials(rows: int, inter: int, dtype: torch.dtype) -> torch.Tensor:
    """gate | up with row 0's gates at the edges of exp(-gate): around its clamp at -87 (gates 86
    .. 200), around its overflow to inf past 88.72 (gates -86 .. -200: silu is -0 there),
    +-inf, NaN, +-0 and tiny values."""
    gate_up = _strided_rows(rows, 2 * inter, dtype, 13)
    edges = [float("nan"), float("inf"), float("-inf"), 0.0, -0.0, 1e-30, -1e-30, 20.0, -20.0]
    edges += [86.0, 87.0, 87.5, 88.0, 88.7, 89.0, 100.0, 103.0, 200.0]
    edges += [-86.0, -87.0, -87.5, -88.0, -88.7, -89.0, -100.0, -103.0, -200.0]
    gate = torch.tensor(edges).repeat(inter // len(edges) + 1)[:inter]
    gate_up[0, :inter] = gate.to(dtype)
    return gate_up


def _fused_cases() -> list[FusedCase]:
    cases = []
    for dtype, t in EXT.items():
        for dim in FUSED_DIMS:
            for rows in FUSED_ROWS:
                seed = dim * 100 + rows
                gen = torch.Generator().manual_seed(seed)
                w32 = torch.rand(dim, generator=gen) + 0.5
                x, r = _strided_rows(rows, dim, dtype, seed), _strided_rows(rows, dim, dtype, seed + 1)
                tag = f"{t}-d{dim}-r{rows}"
                cases.append(FusedCase(f"norm-{tag}", OP_RMS_NORM, x, dim, dim, weight=w32.to(dtype)))
                cases.append(FusedCase(f"add-norm-{tag}", OP_RMS_NORM, x, dim, dim, w32.to(dtype), r))
                cases.append(FusedCase(f"norm-f32w-{tag}", OP_RMS_NORM_F32W, x, dim, dim, w32, eps=1e-6))
                gate_up = _strided_rows(rows, 2 * dim, dtype, seed + 2)
                cases.append(FusedCase(f"silu-{tag}", OP_SILU_MUL, gate_up, dim, dim))
        rope = RotaryEmbedding(HEAD_DIM, 4096, 10000.0, None)
        for rows in FUSED_ROWS:
            # q heads then k and v heads, as the fused QKV projection's rows: the first 3 rotated
            qkv = _strided_rows(rows, (NUM_HEADS + 2) * HEAD_DIM, dtype, rows)
            cos, sin = rope.cos_sin(
                torch.randint(0, 4096, (rows,), generator=torch.Generator().manual_seed(rows)), dtype
            )
            cases.append(
                FusedCase(f"rotary-{t}-r{rows}", OP_ROTARY, qkv, HEAD_DIM, NUM_HEADS, cos=cos, sin=sin)
            )
        for dim in (64, 70):
            cases.append(
                FusedCase(f"silu-edges-{t}-d{dim}", OP_SILU_MUL, _silu_specials(3, dim, dtype), dim, dim)
            )
    for dim in (64, 70):
        gen = torch.Generator().manual_seed(dim)
        w = (torch.rand(dim, generator=gen) + 0.5).bfloat16()
        x, r = _ties_and_specials(3, dim)
        cases.append(FusedCase(f"add-norm-edges-bf16-d{dim}", OP_RMS_NORM, x, dim, dim, w, r))
    return cases


FUSED_CASES = _fused_cases()
FUSED_BY_NAME = {c.name: c for c in FUSED_CASES}
FUSED_NAMES = list(FUSED_BY_NAME)
assert len(FUSED_NAMES) == len(FUSED_CASES)


# ---- paged attention (paged_attention.c on vec128.h) ----

OP_ATTENTION, OP_ATTENTION_I8 = 12, 14  # model-dtype / int8 pools; the harness adds 1 for bf16 queries
# (start, new tokens) per sequence, as tests/model/test_native_kernels.py's _step takes them.
ATTN_SHAPES = {
    # rows attending to 1, 17, 98 .. 100 and 300 keys: whole rows per work item at 2 threads
    "mixed": ([(0, 1), (16, 1), (97, 3), (299, 1)], 20),
    "long": ([(299, 1)], 21),  # a lone row: split by keys into parts (part_keys 0)
    "short": ([(16, 1)], 22),  # a lone short row: split by KV head (part_keys 0)
}
QKV_WIDTH = (ATTN_HEADS + 2 * KV_HEADS) * DIM  # the queries' row stride: a view into a fused QKV output


@dataclass(frozen=True)
class AttnCase:
    name: str
    shape: str  # ATTN_SHAPES key
    dtype: torch.dtype  # queries, output and (unless int8) the pools
    kv_cache_dtype: str  # "auto" (the model's dtype) or "int8"
    window: int | None
    part_keys: int
    threads: int


def _attn_cases() -> list[AttnCase]:
    cases = []
    for dtype, t in EXT.items():
        for kv in ("auto", "int8"):
            for window in (None, 32):
                for part_keys in (0, 128):
                    for threads in (1, 2):
                        name = f"attn-mixed-{t}-{kv}-w{window or 0}-p{part_keys}-t{threads}"
                        cases.append(AttnCase(name, "mixed", dtype, kv, window, part_keys, threads))
            for shape in ("long", "short"):
                cases.append(AttnCase(f"attn-{shape}-{t}-{kv}", shape, dtype, kv, None, 0, 2))
    return cases


ATTN_CASES = _attn_cases()
ATTN_BY_NAME = {c.name: c for c in ATTN_CASES}
ATTN_NAMES = list(ATTN_BY_NAME)


@dataclass
class AttnInputs:
    step: tuple  # _step's (spans, q, k, v, cache_k, cache_v)
    qkv: torch.Tensor  # [rows, QKV_WIDTH]: the queries at the start of each row
    q: torch.Tensor  # [rows, heads, head_dim], a view into qkv
    pool: LayerKV  # the cache with the step's new rows written, as paged_attention writes them
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    row_seq: torch.Tensor  # [rows] int32
    row_pos: torch.Tensor  # [rows] int32


@functools.cache
def _attn_inputs(shape: str, dtype: torch.dtype, kv_cache_dtype: str) -> AttnInputs:
    """One step's queries and cache, and the kernel's indices for its rows (every row a kernel row)."""
    shapes, seed = ATTN_SHAPES[shape]
    step = spans, q, k, v, cache_k, cache_v = _step(seed, dtype, shapes)
    rows = q.shape[0]
    wide = q.new_zeros(rows, QKV_WIDTH)
    wide[:, : ATTN_HEADS * DIM] = q.reshape(rows, -1)
    q_view = wide[:, : ATTN_HEADS * DIM].view(rows, ATTN_HEADS, DIM)
    pool = _pool(cache_k, cache_v, kv_cache_dtype)
    pool.write(build_attention_metadata(spans, BLOCK).slot_mapping, k, v)
    tables = torch.zeros(len(spans), max(len(s.block_ids) for s in spans), dtype=torch.int32)
    for i, s in enumerate(spans):
        tables[i, : len(s.block_ids)] = torch.tensor(s.block_ids, dtype=torch.int32)
    row_seq = torch.cat([torch.full((s.num_new,), i, dtype=torch.int32) for i, s in enumerate(spans)])
    row_pos = torch.cat([torch.arange(s.start, s.start + s.num_new, dtype=torch.int32) for s in spans])
    return AttnInputs(step, wide, q_view, pool, tables, row_seq, row_pos)


def _attn_scale() -> float:
    return DIM**-0.5  # as _attend scales


def _write_attn_case(case: AttnCase, directory: Path) -> None:
    directory.mkdir(parents=True)
    inp = _attn_inputs(case.shape, case.dtype, case.kv_cache_dtype)
    bf16, i8 = case.dtype == torch.bfloat16, case.kv_cache_dtype == "int8"
    rows, pool, ext = inp.q.shape[0], inp.pool, EXT[case.dtype]
    op = (OP_ATTENTION_I8 if i8 else OP_ATTENTION) + bf16
    num_seqs, max_blocks = inp.block_tables.shape
    attn = [KV_HEADS, BLOCK, pool.k.shape[0], num_seqs, max_blocks, case.window or 0, case.part_keys]
    files = {
        "params": torch.tensor([op, rows, DIM, ATTN_HEADS, QKV_WIDTH, case.threads], dtype=torch.int32),
        "attn.i32": torch.tensor(attn, dtype=torch.int32),
        "scale.f32": torch.tensor([_attn_scale()]),
        f"q.{ext}": inp.qkv,
        "block_tables.i32": inp.block_tables,
        "row_seq.i32": inp.row_seq,
        "row_pos.i32": inp.row_pos,
    }
    pool_ext = "i8" if i8 else ext
    files[f"k.{pool_ext}"], files[f"v.{pool_ext}"] = pool.k, pool.v
    if i8:
        files["k_scale.f32"], files["v_scale.f32"] = pool.k_scale, pool.v_scale
    for name, t in files.items():
        (directory / name).write_bytes(_bits(t))


# ---- the dense matmuls (bf16_matmul.c, f32_matmul.c on dense_neon.h) ----

OP_DENSE = 16  # f32_matmul_f32; the harness adds 1 for bf16_matmul_bf16
DENSE_K = {torch.bfloat16: (32, 96), torch.float32: (16, 48)}  # each kernel's K multiple, and 3x it
DENSE_N = [5, 7, 130]  # partial 4-row weight tiles; 130: 33 tiles over 2 threads
DENSE_ROWS = [1, 2, 3, 4, 5, 9]  # passes of 2 activation rows, a lone last row; 3 .. 9 strided
INV_ROWS, INV_N = 7, 7  # the batch-invariance call: [7, K] x [7, K]^T


@dataclass
class DenseCase:
    name: str
    x: torch.Tensor  # [rows, k]; a view with a wider row stride for some
    w: torch.Tensor  # [n, k]
    threads: int


def _dense_cases() -> tuple[list[DenseCase], list[DenseCase]]:
    """(the product cases, the shapes each kernel must refuse)."""
    cases, bad = [], []
    for dtype, t in EXT.items():
        for k in DENSE_K[dtype]:
            for n in DENSE_N:
                for rows in DENSE_ROWS:
                    seed = k * 10000 + n * 10 + rows
                    if rows >= 3:
                        x = _strided_rows(rows, k, dtype, seed)
                    else:
                        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed)).to(dtype)
                    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
                    name = f"dense-{t}-k{k}-n{n}-r{rows}"
                    cases.append(DenseCase(name, x, w, threads=2 if n > 8 else 1))
        multiple = DENSE_K[dtype][0]
        gen = torch.Generator().manual_seed(5)
        for k in (multiple // 2, multiple + 8, 3 * multiple // 2):  # multiples of 8, not of the kernel's K
            x, w = torch.randn(3, k, generator=gen).to(dtype), torch.randn(5, k, generator=gen).to(dtype)
            bad.append(DenseCase(f"dense-bad-{t}-k{k}", x, w, 1))
        x, w = (
            torch.randn(2, multiple, generator=gen).to(dtype),
            torch.randn(5, multiple, generator=gen).to(dtype),
        )
        bad.append(DenseCase(f"dense-bad-{t}-no-rows", x[:0], w, 1))
        bad.append(DenseCase(f"dense-bad-{t}-no-weight-rows", x, w[:0], 1))
    return cases, bad


DENSE_CASES, DENSE_BAD = _dense_cases()
DENSE_BY_NAME = {c.name: c for c in DENSE_CASES + DENSE_BAD}
DENSE_NAMES = [c.name for c in DENSE_CASES]
DENSE_BAD_NAMES = [c.name for c in DENSE_BAD]
# Slices of the invariance call's activation and weight rows, each its own call: every row alone,
# rows at other offsets of other batches (a row first of its 2-row pass in one call, last in the
# other), weight rows alone (a tile with one live row) and at shifted tile positions.
INV_SLICES = [(slice(r, r + 1), slice(None)) for r in range(INV_ROWS)]
INV_SLICES += [(slice(1, 4), slice(None)), (slice(2, 7), slice(None)), (slice(0, 6), slice(None))]
INV_SLICES += [(slice(None), slice(c, c + 1)) for c in (0, 3, 4, 6)]
INV_SLICES += [(slice(None), slice(1, 6)), (slice(3, 5), slice(2, 7))]


def _inv_inputs(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x (strided) and w whose products cancel: at a quarter of the K positions both are 256x
    larger, and another quarter repeats those x values against the negated weights, so each
    exact sum is O(10) while its partial sums reach O(10^5). Their float32 roundings then move
    the result by about a bf16 ulp, so a change in the order of the additions shows in bf16
    outputs too (on randn inputs it would hide below bf16's rounding: a sum folded in another
    order changed none of 49 bf16 outputs, against 11 here)."""
    k = DENSE_K[dtype][1]
    gen = torch.Generator().manual_seed(77)
    x, w = torch.randn(INV_ROWS, k, generator=gen), torch.randn(INV_N, k, generator=gen)
    perm = torch.randperm(k, generator=gen)
    big, echo = perm[: k // 4], perm[k // 4 : k // 2]
    x[:, big] *= 256
    w[:, big] *= 256
    x, w = x.to(dtype), w.to(dtype)
    x[:, echo], w[:, echo] = x[:, big], -w[:, big]
    wide = x.new_zeros(INV_ROWS, k + 40)
    wide[:, 8 : 8 + k] = x
    return wide[:, 8 : 8 + k], w


def _inv_cases() -> list[DenseCase]:
    """The whole invariance call at 2 threads and each slice of it at 1."""
    cases = []
    for dtype, t in EXT.items():
        x, w = _inv_inputs(dtype)
        cases.append(DenseCase(f"dense-inv-{t}-all", x, w, 2))
        for i, (rs, cs) in enumerate(INV_SLICES):
            cases.append(DenseCase(f"dense-inv-{t}-{i}", x[rs], w[cs], 1))
    return cases


DENSE_INV = _inv_cases()
DENSE_BY_NAME.update({c.name: c for c in DENSE_INV})


def _write_dense_case(case: DenseCase, directory: Path) -> None:
    directory.mkdir(parents=True)
    bf16 = case.x.dtype == torch.bfloat16
    (rows, k), n = case.x.shape, case.w.shape[0]
    params = [OP_DENSE + bf16, rows, k, n, case.x.stride(0), case.threads]
    ext = EXT[case.x.dtype]
    files = {"params": torch.tensor(params, dtype=torch.int32), f"x.{ext}": _with_stride(case.x)}
    files[f"w.{ext}"] = case.w
    for name, t in files.items():
        (directory / name).write_bytes(_bits(t))


def _build(march: str, out: Path) -> Path:
    """The harness with the kernels, statically linked; kernel sources compiled warning-free."""
    objects = []
    sources = ["quant_matmul.c", "int8_matmul.c", "fused_ops.c", "paged_attention.c", "bf16_matmul.c"]
    sources.append("f32_matmul.c")
    for src in (HARNESS, *(KERNELS / name for name in sources)):
        obj = out / f"{src.stem}.o"
        cmd = [CC, "-O3", f"-march={march}", "-fopenmp", "-std=c11", "-ffp-contract=fast", "-Wall"]
        cmd += ["-Werror", f"-I{KERNELS}", "-c", str(src), "-o", str(obj)]
        subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=120)
        objects.append(str(obj))
    exe = out / "harness"
    # static libgomp warns at link time that it may dlopen (OpenACC profiling): harmless here
    link = [CC, "-static", "-fopenmp", *objects, "-o", str(exe), "-lm"]
    subprocess.run(link, check=True, capture_output=True, text=True, timeout=120)
    return exe


@pytest.fixture(scope="module", params=MARCHES)
def outputs(request, tmp_path_factory) -> tuple[str, Path]:
    """Every case run through the harness built for one -march: (march, the cases' root)."""
    march = request.param
    root = tmp_path_factory.mktemp(march.replace("+", "_").replace(".", "_"))
    try:
        exe = _build(march, root)
    except subprocess.CalledProcessError as exc:
        pytest.fail(f"the aarch64 build ({march}) failed:\n{exc.stderr}")
    dirs = []
    for i, case in enumerate(CASES):
        directory = root / case.name
        _write_case(case, directory, threads=2 if i % 3 == 0 else 1)  # some cases through OpenMP's threads
        dirs.append(str(directory))
    for case in FUSED_CASES:  # 2 threads: the 17-row cases take the parallel loop
        directory = root / case.name
        _write_fused_case(case, directory, threads=2)
        dirs.append(str(directory))
    for case in ATTN_CASES:
        directory = root / case.name
        _write_attn_case(case, directory)
        dirs.append(str(directory))
    for case in DENSE_BY_NAME.values():
        directory = root / case.name
        _write_dense_case(case, directory)
        dirs.append(str(directory))
    run = subprocess.run([QEMU, str(exe), *dirs], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    lanes = subprocess.run([QEMU, str(exe), "--lanes"], capture_output=True, text=True, timeout=60)
    assert lanes.returncode == 0, lanes.stderr
    (root / "lanes").write_text(lanes.stdout)
    available = subprocess.run([QEMU, str(exe), "--available"], capture_output=True, text=True, timeout=60)
    assert available.returncode == 0, available.stderr
    (root / "available").write_text(available.stdout)
    return march, root


# ---- the definitions the x86 tests check against ----


# the same functions tests/model/test_quant_matmul.py checks the x86 kernels with
_quant_reference = quant_definition


def _exact(form: Int8Rotated, q: torch.Tensor, row_scale: torch.Tensor) -> torch.Tensor:
    """The product from its parts: int64 sums of the rounded values, scaled, rounded once."""
    sums = q.long() @ form.int8_weight().long().T  # [rows, out]
    col_scale = form.scale[: form.out_features]
    return (sums.float() * (row_scale[:, None] * col_scale[None, :])).bfloat16()


@functools.cache
def _x86_kernel():
    """The x86 int8 kernel where it runs here (None elsewhere): the NEON one must match it bit for bit."""
    return load_int8_matmul()


QUANT_NAMES = [c.name for c in CASES if c.op != OP_INT8]
INT8_NAMES = [c.name for c in CASES if c.op == OP_INT8]


@functools.cache
def _quant_expected(name: str) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(the definition, the float product, bf16's error against it): the same for every build."""
    case = BY_NAME[name]
    w = case.form.dequantize()
    exact = case.x @ w.T
    bf16 = ((case.x.bfloat16().float() @ w.T - exact).norm() / exact.norm()).item()
    return _quant_reference(case.form, case.x), exact, bf16


@pytest.mark.parametrize("name", QUANT_NAMES)
def test_q4_q8_match_definition(outputs, name):
    _, root = outputs
    case = BY_NAME[name]
    rows, n = case.x.shape[0], case.form.out_features
    y = _read(root / name / "y.f32", torch.float32, (rows, n))
    reference, exact, bf16 = _quant_expected(name)
    torch.testing.assert_close(y, reference, atol=2e-5, rtol=1e-5)
    ours = ((y - exact).norm() / exact.norm()).item()
    assert ours < 8 * bf16, (ours, bf16)


@pytest.mark.parametrize("name", INT8_NAMES)
def test_int8_rounding_and_product(outputs, name):
    _, root = outputs
    case = BY_NAME[name]
    rows, k = case.x.shape
    n = case.form.out_features
    out = root / name
    y = _read(out / "y.bf16", torch.bfloat16, (rows, n))
    q = _read(out / "q.i8", torch.int8, (rows, k))
    scale = _read(out / "qscale.f32", torch.float32, (rows,))
    row_max = _read(out / "rowmax.f32", torch.float32, (rows,))
    x = case.x.contiguous()
    if case.given_max is None:
        # the rounding against torch's transform, as the x86 test checks it
        q_ref, scale_ref = _reference_quantize(x)
        torch.testing.assert_close(scale, scale_ref, rtol=1e-6, atol=0)
        assert (q.int() - q_ref.int()).abs().max().item() <= 1
        assert (q != q_ref).float().mean().item() < 1e-3
        torch.testing.assert_close(row_max, scale_ref * 127, rtol=1e-6, atol=0)
    else:
        assert torch.equal(scale, case.given_max / 127)
    zero_rows = (x == 0).all(dim=1)
    assert not q[zero_rows].any() and not scale[zero_rows].any()
    # the product is exact int8 arithmetic on the kernel's own rounding
    assert torch.equal(y, _exact(case.form, q, scale))
    ref = F.linear(x.float(), case.form.dequantize())
    assert ((y.float() - ref).norm() / ref.norm()).item() < 0.03
    x86 = _x86_kernel()
    if x86 is not None:  # the same bits as the x86 kernel
        q86, scale86 = x86.quantize(case.x, case.given_max)
        assert torch.equal(q, q86) and torch.equal(scale, scale86)
        assert torch.equal(row_max, x86.rotated_row_max(case.x))
        form = case.form
        y86 = x86(case.x, form.packed, form.colsum, form.scale, n, given_max=case.given_max)
        assert torch.equal(y, y86)


@pytest.mark.parametrize("march", MARCHES)
def test_whole_library_builds_for_aarch64(march, tmp_path):
    """The library native.py builds on an Arm machine: every kernel source together, as one
    shared object, with the flags of an Arm level (layers/isa.py), without a warning."""
    from fornax.layers.native import BASE_FLAGS

    sources = sorted(str(p) for p in KERNELS.glob("*.c"))
    cmd = [CC, BASE_FLAGS[0], f"-march={march}", *BASE_FLAGS[1:], "-Wall", "-Werror", *sources]
    subprocess.run(
        [*cmd, "-o", str(tmp_path / "lib.so"), "-lm"], check=True, capture_output=True, timeout=300
    )


# ---- the fused elementwise ops: against torch's expressions and the x86 library ----


def _fused_outputs(root: Path, case: FusedCase) -> dict[str, torch.Tensor]:
    """What the harness wrote for a case: y (and sum for the residual add), as the x86 wrapper returns them."""
    out, dtype = root / case.name, case.x.dtype
    rows, ext = case.x.shape[0], EXT[dtype]
    if case.op == OP_ROTARY:  # the whole rows after the rotation in place
        return {"y": _read(out / f"y.{ext}", dtype, (rows, case.x.stride(0)))}
    got = {"y": _read(out / f"y.{ext}", dtype, (rows, case.n))}
    if case.residual is not None:
        got["sum"] = _read(out / f"sum.{ext}", dtype, (rows, case.n))
    return got


@functools.cache
def _fused_reference(name: str) -> dict[str, torch.Tensor]:
    """The torch expressions the kernels mirror (layers/ops.py's TorchOps, as the x86 tests use them)."""
    case, ops = FUSED_BY_NAME[name], TorchOps()
    if case.op == OP_RMS_NORM and case.residual is not None:
        y, summed = ops.add_rms_norm(case.x, case.residual, case.weight, case.eps)
        return {"y": y, "sum": summed}
    if case.op == OP_RMS_NORM:
        return {"y": ops.rms_norm(case.x, case.weight, case.eps)}
    if case.op == OP_RMS_NORM_F32W:
        return {"y": ops.rms_norm_f32_weight(case.x, case.weight, case.eps)}
    if case.op == OP_SILU_MUL:
        return {"y": ops.silu_mul(case.x)}
    rows = case.x.shape[0]
    rotated = ops.rotary_(case.x, case.n, case.cos, case.sin).reshape(rows, -1)
    full = _with_stride(case.x)
    full[:, : rotated.shape[1]] = rotated
    return {"y": full}


@functools.cache
def _fused_x86() -> FusedOps | None:
    """The x86 library's fused ops where they build here (None elsewhere)."""
    return load_fused_ops()


@functools.cache
def _fused_x86_outputs(name: str) -> dict[str, torch.Tensor] | None:
    """The same case through the x86 library (AVX-512 or AVX2 on this machine), or None."""
    fused, case = _fused_x86(), FUSED_BY_NAME[name]
    if fused is None:
        return None
    if case.op == OP_RMS_NORM:
        y, summed = fused.rms_norm(case.x, case.weight, case.eps, case.residual)
        return {"y": y} if summed is None else {"y": y, "sum": summed}
    if case.op == OP_RMS_NORM_F32W:
        return {"y": fused.rms_norm_f32_weight(case.x, case.weight, case.eps)}
    if case.op == OP_SILU_MUL:
        return {"y": fused.silu_mul(case.x)}
    base = _with_stride(case.x)
    fused.rotary_(base[:, : case.x.shape[1]], case.n, case.cos, case.sin)
    return {"y": base}


def _differing_bits(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Where a and b differ bit for bit, NaN counting as equal to any NaN (its payload is not specified)."""
    ints = {torch.float32: torch.int32, torch.bfloat16: torch.int16}[a.dtype]
    return (a.view(ints) != b.view(ints)) & ~(a.isnan() & b.isnan())


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many representable values apart a and b are (finite, same sign where nonzero)."""
    ints = {torch.float32: torch.int32, torch.bfloat16: torch.int16}[a.dtype]
    ai, bi = a.view(ints).long(), b.view(ints).long()
    return torch.where(_differing_bits(a, b), (ai - bi).abs(), torch.zeros_like(ai))


def _assert_near(got: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    """Within tol of the reference's largest finite magnitude (the x86 tests' measure), with NaN
    and the infinities exactly where the reference has them."""
    got, ref = got.float(), ref.float()
    assert torch.equal(got.isnan(), ref.isnan()) and torch.equal(got.isinf(), ref.isinf())
    assert torch.equal(got[ref.isinf()], ref[ref.isinf()])
    finite = ref.isfinite()
    err = (got[finite] - ref[finite]).abs().max().item()
    assert err <= tol * ref[finite].abs().max().item(), err


def test_neon_build_vectorizes_the_fused_ops(outputs):
    """vec.h picks NEON's 4 lanes under every -march here, so the checks below test vec128.h
    and not fused_ops.c's scalar loops."""
    _, root = outputs
    assert (root / "lanes").read_text().split() == ["lanes", "4"]


@pytest.mark.parametrize("name", FUSED_NAMES)
def test_fused_ops_match_torch(outputs, name):
    """The torch expressions, with test_native_kernels' tolerances for the x86 kernels: the
    residual add's sum exactly, bf16 rotary exactly (every rounding reproduced), the norms and
    SiLU * up within FUSED_TOL of the largest value; f32 rotary within 1e-6 of it (the x86
    test's 1e-6 absolute is on randn, |values| < ~5; these rows are 3x randn)."""
    _, root = outputs
    case = FUSED_BY_NAME[name]
    got, ref = _fused_outputs(root, case), _fused_reference(name)
    assert got.keys() == ref.keys()
    if "sum" in got:
        assert not _differing_bits(got["sum"], ref["sum"]).any()
    dtype = case.x.dtype
    if case.op == OP_ROTARY:
        _assert_near(got["y"], ref["y"], 1e-6 if dtype == torch.float32 else 0.0)
    else:
        _assert_near(got["y"], ref["y"], FUSED_TOL[dtype])


def _vector_columns_differ(case: FusedCase) -> slice:
    """The columns that NEON's vector loop covers but x86's (8 or 16 lanes) leaves to its scalar
    tail: SiLU's exp there is exp128's polynomial against libm's expf."""
    assert all(d // 8 * 8 == d // 16 * 16 for d in FUSED_DIMS)  # AVX2 and AVX-512 split these alike
    return slice(case.k // 16 * 16, case.k // 4 * 4)


@pytest.mark.parametrize("name", FUSED_NAMES)
def test_fused_ops_match_the_x86_library(outputs, name):
    """NEON against the x86 library's own output (AVX-512 or AVX2, whichever this machine
    builds). The same loops, roundings and exp algorithm, so bit for bit, except:

    - float32 norms: the sum of squares is added in NEON's 4 lanes against x86's 8 or 16 (and
      a different scalar tail), so 1/rms differs in its last bits; measured at most 4 float32
      ulps in the output against AVX2, and 4 against AVX-512's order too (emulated in numpy,
      which reproduces both the NEON and the AVX2 outputs bit for bit); asserted at 4.
    - bf16 norms: the same sum, but the output is rounded to bf16 after, so only a float32
      value within those few ulps of a bf16 rounding tie can come out one bf16 ulp apart:
      measured 0 of ~45,000 values per build; asserted <= 1 ulp in under 0.1% of values.
    - float32 rotary: with -ffp-contract=fast each compiler fuses a*cos - b*sin into one FMA,
      gcc for x86 with a*cos exact and b*sin rounded, gcc for AArch64 the other way round
      (b*cos + a*sin: both keep b*cos exact, and agree). Each result is off by one product's
      rounding and its own, so asserted |diff| <= 2^-22 * (|a cos| + |b sin|)
      (measured up to 2^-20 on values up to ~12, i.e. one ulp of the products; up to ~1,000
      ulps of a result that nearly cancels). bf16 rotary rounds each product: bit for bit.
    - SiLU * up: in the columns NEON's vector loop covers but x86's leaves to its scalar tail
      (64 .. 67 of 70) exp128 meets libm's expf, measured up to 3 float32 ulps, asserted
      there; bf16 within 1 ulp there (measured 0). Elsewhere bit for bit (the same exp
      polynomial in the vector lanes, the same expf in the scalar tails).
    """
    x86 = _fused_x86_outputs(name)
    if x86 is None:
        pytest.skip("the x86 library does not build here")
    _, root = outputs
    case = FUSED_BY_NAME[name]
    got = _fused_outputs(root, case)
    assert got.keys() == x86.keys()
    if "sum" in got:  # one rounded add per value
        assert not _differing_bits(got["sum"], x86["sum"]).any()
    y, y86 = got["y"], x86["y"]
    assert torch.equal(y.isnan(), y86.isnan())
    f32 = case.x.dtype == torch.float32
    if case.op in (OP_RMS_NORM, OP_RMS_NORM_F32W):
        ulps = _ulps(y, y86)
        if f32:
            assert ulps.max().item() <= 4, ulps.max().item()
        else:
            assert ulps.max().item() <= 1 and (ulps > 0).float().mean().item() < 1e-3
    elif case.op == OP_ROTARY and f32:
        x = _with_stride(case.x)
        heads = case.n * case.k
        a = x[:, :heads].view(-1, case.n, case.k)
        swapped = torch.cat((a[..., case.k // 2 :], a[..., : case.k // 2]), dim=-1)
        products = a.abs() * case.cos[:, None].abs() + swapped.abs() * case.sin[:, None].abs()
        bound = torch.zeros_like(x)
        bound[:, :heads] = products.flatten(1) * 2.0**-22
        assert ((y - y86).abs() <= bound).all()  # the columns past the rotated heads: untouched, exactly
    elif case.op == OP_SILU_MUL:
        mixed = _vector_columns_differ(case)
        ulps = _ulps(y, y86)
        assert not ulps[:, : mixed.start].any() and not ulps[:, mixed.stop :].any()
        assert (ulps[:, mixed] <= (3 if f32 else 1)).all()
    else:  # bf16 rotary
        assert not _differing_bits(y, y86).any()


# ---- paged attention: against the torch path and the x86 kernel ----


def _attn_output(root: Path, case: AttnCase) -> torch.Tensor:
    rows = _attn_inputs(case.shape, case.dtype, case.kv_cache_dtype).q.shape[0]
    return _read(root / case.name / f"y.{EXT[case.dtype]}", case.dtype, (rows, ATTN_HEADS, DIM))


@functools.cache
def _attn_reference(shape: str, dtype: torch.dtype, kv_cache_dtype: str, window: int | None) -> torch.Tensor:
    """The torch path (no kernel) over the same step: what test_native_kernels holds the x86 kernel to."""
    spans, q, k, v, cache_k, cache_v = _attn_inputs(shape, dtype, kv_cache_dtype).step
    return _attend(spans, q, k, v, cache_k, cache_v, None, window, kv_cache_dtype)[0]


# test_kernel_matches_torch_path_on_a_mixed_step's bounds on the largest difference, both pool kinds
ATTN_TORCH_TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("name", ATTN_NAMES)
def test_paged_attention_matches_torch(outputs, name):
    """NEON attention against the torch path (masked softmax over gathered K/V, int8 rows
    dequantized) within the tolerances the x86 kernel is held to there."""
    _, root = outputs
    case = ATTN_BY_NAME[name]
    got = _attn_output(root, case).float()
    ref = _attn_reference(case.shape, case.dtype, case.kv_cache_dtype, case.window)
    assert got.isfinite().all()
    err = (got - ref).abs().max().item()
    assert err < ATTN_TORCH_TOL[case.dtype], err


@functools.cache
def _attn_x86(name: str) -> torch.Tensor | None:
    """The same call through the x86 library (AVX-512 or AVX2 here) with the case's thread count
    (part_keys 0 splits the work by it), or None where the library does not build."""
    kernel = load_paged_attention()
    if kernel is None:
        return None
    case = ATTN_BY_NAME[name]
    inp = _attn_inputs(case.shape, case.dtype, case.kv_cache_dtype)
    before = torch.get_num_threads()
    torch.set_num_threads(case.threads)
    try:
        return kernel(
            inp.q,
            inp.pool,
            inp.block_tables,
            inp.row_seq,
            inp.row_pos,
            BLOCK,
            _attn_scale(),
            case.window,
            case.part_keys,
        )
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("name", ATTN_NAMES)
def test_paged_attention_matches_the_x86_library(outputs, name):
    """NEON against the x86 kernel on the same inputs, split into the same work items (the
    same thread count). Not bit for bit: the score dot products add their products in other
    lane orders (4 accumulators of 4 lanes against AVX2's 2 of 8, AVX-512's 2 of 16 or its
    bf16 dot products), the softmax sums likewise, and NEON's exp128 covers keys that x86
    leaves to libm's expf in its longer scalar tail (the last n % 8 keys on AVX2 against
    n % 4); the value pass is the same FMA chain per element on both.

    - float32: measured against AVX2 at most 1.95e-7 of the largest |value| (1-2 ulps
      there; ~80% of values differ in their last bits, more ulps only where a value is near
      zero), the same in every build; asserted within 1e-6 of it, room for AVX-512's orders.
    - bf16: the output is rounded after, so only a float32 result that close to a rounding
      boundary can come out one bf16 ulp apart: measured 0 differing values against AVX2;
      asserted <= 1 ulp in under 1% of values.
    """
    x86 = _attn_x86(name)
    if x86 is None:
        pytest.skip("the x86 library does not build here")
    _, root = outputs
    case = ATTN_BY_NAME[name]
    got = _attn_output(root, case)
    scale = x86.float().abs().max().item()
    err = (got.float() - x86.float()).abs().max().item()
    if case.dtype == torch.float32:
        assert err <= 1e-6 * scale, err / scale
    else:
        assert _ulps(got, x86).max().item() <= 1 and (got != x86).float().mean().item() < 0.01


# ---- the dense matmuls: the exact product, the AVX2 path's order, batch invariance ----


def _dense_output(root: Path, case: DenseCase) -> torch.Tensor:
    """The harness's y for a case whose status was 0."""
    status = _read(root / case.name / "status.i32", torch.int32, (1,)).item()
    assert status == 0, f"{case.name}: status {status}"
    shape = (case.x.shape[0], case.w.shape[0])
    return _read(root / case.name / f"y.{EXT[case.x.dtype]}", case.x.dtype, shape)


def _fma32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """float32 a * b + c rounded once, as FMA (vfmaq_f32, _mm256_fmadd_ps) rounds it. The product
    of two float32 values is exact in float64; the sum is rounded there to odd (TwoSum gives the
    exact error; an inexact sum with an even last bit moves one float64 ulp toward the true
    value), which leaves the rounding to float32 correct: no double rounding."""
    p = a.astype(np.float64) * b.astype(np.float64)
    c = c.astype(np.float64)
    s = p + c
    bb = s - p
    err = (p - (s - bb)) + (c - bb)
    even = (s.view(np.int64) & 1) == 0
    s = np.where((err != 0) & even, np.nextafter(s, np.where(err > 0, np.inf, -np.inf)), s)
    return s.astype(np.float32)


@functools.cache
def _lane_order(name: str) -> torch.Tensor:
    """The float32 sums in dense_avx2.h's order, which dense_neon.h keeps: per output 8 lanes,
    lane l taking K positions l, l + 8, ... by FMA in K order; then hsum256's fold (upper 4 lanes
    onto the lower, (0 + 2) + (1 + 3)). Rounded to bf16 (to nearest even) for bf16 cases."""
    case = DENSE_BY_NAME[name]
    x, w = case.x.float().numpy(), case.w.float().numpy()
    acc = np.zeros((x.shape[0], w.shape[0], 8), dtype=np.float32)
    for i in range(0, x.shape[1], 8):
        acc = _fma32(w[None, :, i : i + 8], x[:, None, i : i + 8], acc)
    half = acc[..., :4] + acc[..., 4:]
    sums = torch.from_numpy((half[..., 0] + half[..., 2]) + (half[..., 1] + half[..., 3]))
    return sums.to(case.x.dtype)


def test_dense_kernels_are_available(outputs):
    """bf16_matmul_available() and f32_matmul_available() say 1 in every NEON build (the Python
    side, and deterministic mode, take the kernels only where they do)."""
    _, root = outputs
    assert (root / "available").read_text().split() == ["bf16_matmul", "1", "f32_matmul", "1"]


@pytest.mark.parametrize("name", DENSE_NAMES)
def test_dense_matches_the_exact_product(outputs, name):
    """bf16: each output within one bf16 ulp of the float64 product (products exact in float32,
    float32 sums, one rounding), as test_bf16_matmul checks the x86 kernels. float32: within
    1e-5 relative plus K float32 roundings of sum |x w| (the bound of any order of K - 1 adds).
    Both: bit for bit the AVX2 path's sums (_lane_order)."""
    _, root = outputs
    case = DENSE_BY_NAME[name]
    y = _dense_output(root, case)
    exact = case.x.double() @ case.w.double().T
    k = case.x.shape[1]
    if case.x.dtype == torch.bfloat16:
        ulp = torch.ldexp(torch.ones_like(exact), torch.frexp(exact)[1] - 8)  # bf16 keeps 8 significant bits
        assert bool(((y.double() - exact).abs() <= ulp + 1e-30).all()), (y.double() - exact).abs().max()
    else:
        bound = 1e-5 * exact.abs() + k * 2.0**-24 * (case.x.double().abs() @ case.w.double().abs().T)
        assert bool(((y.double() - exact).abs() <= bound).all()), (y.double() - exact).abs().max()
    assert not _differing_bits(y, _lane_order(name)).any()


# The x86 levels whose dense kernel is the AVX2 tile (dense_avx2.h); the others differ in their order.
X86_AVX2_DENSE = {torch.bfloat16: ("avx2", "avx512", "avx512-vnni"), torch.float32: ("avx2",)}


@pytest.mark.parametrize("name", [*DENSE_NAMES, "dense-inv-bf16-all", "dense-inv-f32-all"])
def test_dense_matches_the_x86_library(outputs, name):
    """Where this machine's library runs the AVX2 tile, NEON gives its bits: the same FMAs in the
    same lanes, the same fold, the same bf16 rounding (deterministic mode's answer is the same on
    an AVX2 x86 and an Arm machine). Skipped at the AVX-512 levels (16 lanes, other orders)."""
    from fornax.layers import isa
    from fornax.layers.native import load_bf16_matmul, load_f32_matmul

    case = DENSE_BY_NAME[name]
    bf16 = case.x.dtype == torch.bfloat16
    kernel = load_bf16_matmul() if bf16 else load_f32_matmul()
    if kernel is None or isa.current().name not in X86_AVX2_DENSE[case.x.dtype]:
        pytest.skip("the x86 library does not run the AVX2 dense tile here")
    _, root = outputs
    before = torch.get_num_threads()
    torch.set_num_threads(case.threads)
    try:
        y86 = kernel(case.x, case.w.contiguous())
    finally:
        torch.set_num_threads(before)
    assert not _differing_bits(_dense_output(root, case), y86).any()


@pytest.mark.parametrize("name", DENSE_BAD_NAMES)
def test_dense_refuses_bad_shapes(outputs, name):
    """K not a multiple of 32 (bf16) / 16 (float32), as on x86, no rows, no weight rows: status 1,
    nothing written."""
    _, root = outputs
    out = root / name
    assert _read(out / "status.i32", torch.int32, (1,)).item() == 1
    assert not list(out.glob("y.*"))


@pytest.mark.parametrize("dtype", list(EXT), ids=list(EXT.values()))
def test_dense_rows_are_batch_invariant(outputs, dtype):
    """Each slice of the invariance call (rows alone, at other offsets of other batches, weight
    rows alone or at other tile positions; 1 thread against 2) gives the whole call's bits for
    its rows and columns, and the whole call is itself the AVX2 order's (_lane_order). The
    inputs cancel (_inv_inputs), so an order that moved with the tile would show in bf16 too."""
    _, root = outputs
    t = EXT[dtype]
    whole = _dense_output(root, DENSE_BY_NAME[f"dense-inv-{t}-all"])
    assert not _differing_bits(whole, _lane_order(f"dense-inv-{t}-all")).any()
    for i, (rs, cs) in enumerate(INV_SLICES):
        part = _dense_output(root, DENSE_BY_NAME[f"dense-inv-{t}-{i}"])
        assert not _differing_bits(part, whole[rs, cs]).any(), (rs, cs)
