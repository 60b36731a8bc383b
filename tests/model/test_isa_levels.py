"""Every instruction-set level this CPU runs, tested on this one machine (layers/isa.py).

The rest of the suite runs at the CPU's top level (the -march=native build). Here the kernel
tests and the greedy-vs-transformers tests run again, each lower level in its own pytest
process with FORNAX_ISA set (a process builds and loads one library), so an AVX-512 machine
also checks its AVX2 paths, and an AMX one its AVX-512 paths. On a CPU with one level there is
nothing lower to run: skipped, saying so.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fornax.layers import isa

ROOT = Path(__file__).resolve().parents[2]
# Each kernel against its reference, the one-call step against op by op, batch invariance.
KERNEL_TESTS = [
    "tests/model/test_quant_matmul.py",
    "tests/model/test_int8_rotated.py",
    "tests/model/test_bf16_matmul.py",
    "tests/model/test_native_kernels.py",
    "tests/model/test_native_step.py",
    "tests/model/test_batch_invariant_kernels.py",
]
# Greedy output equal to transformers' on a tiny model of every family (the lowest level only:
# the top level is the main run's).
GREEDY_TESTS = ["tests/model/test_tiny_models.py::test_greedy_matches_transformers"]

LOWER = [level.name for level in isa.supported_levels(isa.cpu_flags())][:-1]


def _pytest(level: str, targets: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "FORNAX_ISA": level}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *targets]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)


@pytest.mark.skipif(not LOWER, reason="this CPU runs one instruction-set level: the main run covers it")
@pytest.mark.parametrize("level", LOWER or ["none"])
def test_kernels_at_a_lower_level(level):
    targets = KERNEL_TESTS + (GREEDY_TESTS if level == LOWER[0] else [])
    done = _pytest(level, targets)
    assert done.returncode == 0, f"FORNAX_ISA={level}:\n{done.stdout[-4000:]}\n{done.stderr[-2000:]}"
    assert " passed" in done.stdout.splitlines()[-1]


def test_the_level_in_use_is_the_one_asked_for(tmp_path):
    """A capped process builds and loads its level's own library, and says so."""
    here = [level.name for level in isa.supported_levels(isa.cpu_flags())]
    if not here:
        pytest.skip("this CPU runs none of the levels")
    code = "from fornax.layers import kernel_plan; print(kernel_plan.isa_summary())"
    env = {**os.environ, "FORNAX_ISA": here[0], "FORNAX_HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == isa.LEVELS[here[0]].summary
    assert list((tmp_path / "kernels").glob(f"fornax_kernels-{here[0]}-*.so"))


@pytest.mark.parametrize("level", [level.name for level in isa.X86_LEVELS])
def test_every_x86_level_builds_here(level, tmp_path):
    """Each level's generic flags build the whole library without a warning, whatever this CPU
    runs (compiling needs no such CPU): a level that only an AVX-512 or AMX machine runs still
    builds on an AVX2 one, where its code cannot be executed."""
    from fornax.layers.native import BASE_FLAGS, KERNEL_DIR

    if not shutil.which("cc") or ("x86" not in platform.machine() and platform.machine() != "amd64"):
        pytest.skip("needs an x86 C compiler")
    sources = sorted(str(p) for p in KERNEL_DIR.glob("*.c"))
    cmd = ["cc", BASE_FLAGS[0], *isa.LEVELS[level].flags, *BASE_FLAGS[1:], "-Wall", "-Werror", *sources]
    subprocess.run(
        [*cmd, "-o", str(tmp_path / "lib.so"), "-lm"], check=True, capture_output=True, timeout=300
    )
