"""The Arm NEON integer matmuls (kernels/quant_matmul_neon.h, kernels/int8_matmul_neon.h),
cross-compiled for AArch64 and run under qemu-user, against the definitions the x86 tests use.

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

from fornax.layers.linear import BlockInt4, BlockInt8, Int8Rotated, hadamard_blocks
from fornax.layers.native import load_int8_matmul
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


def _build(march: str, out: Path) -> Path:
    """The harness with the kernels, statically linked; kernel sources compiled warning-free."""
    objects = []
    for src in (HARNESS, KERNELS / "quant_matmul.c", KERNELS / "int8_matmul.c"):
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
    run = subprocess.run([QEMU, str(exe), *dirs], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    return march, root


# ---- the definitions the x86 tests check against ----


# the same functions tests/model/test_quant_matmul.py checks the x86 kernels with
_quant_reference = quant_definition


def _reference_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    v = hadamard_blocks(x)  # [rows, k] float32
    m = v.abs().amax(dim=1)
    inv = torch.where(m > 0, 127.0 / m, torch.zeros_like(m))
    return torch.round(v * inv[:, None]).clamp(-127, 127).to(torch.int8), m / 127.0


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
