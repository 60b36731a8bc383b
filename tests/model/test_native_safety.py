"""The native kernels' packaging, fallback, cache integrity and index checks (layers/native.py).

- The wheel carries every file the C sources include, so an installed fornax can build them.
- Where the library cannot be built (no compiler, an unwritable cache directory, no home
  directory, a failing compiler), the process says why in exactly one line and runs on torch
  ops; each case runs in its own process, as the warning is once per process.
- A cached library is loaded only when its build record vouches for the file: a stale or
  tampered library, or a record for other sources, is rebuilt. A stand-in compiler that
  copies the real library keeps these rebuilds instant.
- With FORNAX_DEBUG=1 the wrappers reject out-of-range slots, block ids and row maps with a
  Python error before calling C. Those calls run in a child process, so a missing check shows
  as a crashed child (a failed test), never as a crashed pytest.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
import torch

from fornax.config import debug_checks_enabled
from fornax.layers import isa, native

REPO = Path(__file__).resolve().parents[2]
KERNELS_IN_WHEEL = "fornax/layers/kernels/"
LOCAL_INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.MULTILINE)


def _run_python(script: str, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """`script` in a fresh interpreter of this venv, from the repository root."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _env(**changes: str | None) -> dict[str, str]:
    """This process's environment without FORNAX_DEBUG, then `changes` (None: removed)."""
    env = {k: v for k, v in os.environ.items() if k != "FORNAX_DEBUG"}
    for key, value in changes.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


# --- packaging -------------------------------------------------------------------------------


def _build_wheel(tmp_path: Path) -> zipfile.ZipFile:
    """A wheel of a copy of the project (building in place would write build/ and egg-info into
    the shared tree). Offline: setuptools from this venv, no build isolation, no index."""
    pytest.importorskip("setuptools")
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    shutil.copytree(REPO / "fornax", src / "fornax", ignore=shutil.ignore_patterns("__pycache__", "vendor"))
    out = tmp_path / "wheel"
    offline = ["--no-deps", "--no-build-isolation", "--no-index", "-q"]
    pip_wheel = [sys.executable, "-m", "pip", "wheel", *offline]
    subprocess.run([*pip_wheel, "-w", str(out), str(src)], check=True, capture_output=True, timeout=300)
    (wheel,) = out.glob("fornax-*.whl")
    return zipfile.ZipFile(wheel)


def _local_includes(text: str) -> list[str]:
    return LOCAL_INCLUDE.findall(text)


def test_wheel_ships_every_file_the_kernels_include(tmp_path):
    """Every `#include "..."` of every kernel source, followed through the headers, resolves
    inside the wheel (without the headers in package-data, bf16.h and vec512.h were missing and
    an installed fornax could never build its kernels)."""
    wheel = _build_wheel(tmp_path)
    shipped = {n[len(KERNELS_IN_WHEEL) :] for n in wheel.namelist() if n.startswith(KERNELS_IN_WHEEL)}
    sources = sorted(p.name for p in native.KERNEL_DIR.glob("*.c"))
    assert sources and set(sources) <= shipped, f"sources missing from the wheel: {set(sources) - shipped}"
    missing: set[tuple[str, str]] = set()
    seen: set[str] = set()
    todo = list(sources)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        # Read from the repository, so that a header the wheel lacks still has its own includes followed.
        for included in _local_includes((native.KERNEL_DIR / name).read_text()):
            if included not in shipped:
                missing.add((name, included))
            todo.append(included)
    assert not missing, f"included by the kernels but not in the wheel (package-data): {sorted(missing)}"


# --- fallback --------------------------------------------------------------------------------

# Every loader, then a norm through the public op selector: torch ops must serve it.
FALLBACK_SCRIPT = """
    {prelude}
    import torch
    from fornax.layers import native
    from fornax.layers.ops import TORCH_OPS, layer_ops

    assert not native.DEBUG_CHECKS, "off without FORNAX_DEBUG"
    loaders = [native.load_paged_attention, native.load_fused_ops, native.load_quant_matmul,
               native.load_bf16_matmul, native.load_int8_matmul, native.load_decode_step]
    got = [load() for load in loaders] + [load() for load in loaders]
    assert all(g is None for g in got), got
    ops = layer_ops("native", torch.float32)
    assert ops is TORCH_OPS
    x = torch.tensor([[3.0, 4.0]])
    out = ops.rms_norm(x, torch.ones(2), 0.0)
    assert torch.allclose(out, x / x.pow(2).mean().sqrt()), out
    print("fell back")
"""

# Path.home() consults the passwd database when HOME is unset; this stands in for a user
# without an entry (a container's arbitrary uid), the case in which it raises.
NO_PASSWD_ENTRY = """
    import pwd
    def _no_entry(uid):
        raise KeyError(uid)
    pwd.getpwuid = _no_entry
"""


def _fallback_case(case: str, tmp_path: Path) -> tuple[dict[str, str], str, str]:
    """(environment, prelude, what the warning must name) for one way of having no kernels."""
    home = str(tmp_path / "home")  # empty: no cached library, so a build is needed
    if case == "no compiler on PATH":
        empty_bin = tmp_path / "bin"
        empty_bin.mkdir()
        return _env(FORNAX_HOME=home, PATH=str(empty_bin), CC=None), "", "no C compiler found"
    if case == "CC names no compiler":
        return _env(FORNAX_HOME=home, CC="/nonexistent/cc"), "", "CC=/nonexistent/cc"
    if case == "compiler fails":
        cc = tmp_path / "failing-cc"
        cc.write_text("#!/bin/sh\necho 'kernel.c:1:1: error: no luck today' >&2\nexit 1\n")
        cc.chmod(0o755)
        return _env(FORNAX_HOME=home, CC=str(cc)), "", "the build failed: kernel.c:1:1: error: no luck"
    if case == "cache directory unwritable":
        # Tests run as root, which chmod does not stop: nobody can create a path under a regular file.
        blocker = tmp_path / "a-file"
        blocker.write_text("")
        env = _env(FORNAX_HOME=str(blocker / "cache"), CC=None)
        return env, "", f"cannot write to {blocker}/cache/kernels"
    assert case == "no home directory"
    return _env(HOME=None, FORNAX_HOME=None), NO_PASSWD_ENTRY, "no home directory for the cache (HOME unset)"


FALLBACK_CASES = [
    "no compiler on PATH",
    "CC names no compiler",
    "compiler fails",
    "cache directory unwritable",
    "no home directory",
]


@pytest.mark.parametrize("case", FALLBACK_CASES)
def test_unavailable_kernels_fall_back_with_one_line(case, tmp_path):
    env, prelude, reason = _fallback_case(case, tmp_path)
    proc = _run_python(textwrap.dedent(FALLBACK_SCRIPT).format(prelude=textwrap.dedent(prelude)), env)
    assert proc.returncode == 0 and proc.stdout.strip() == "fell back", proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, f"expected one warning line, got:\n{proc.stderr}"
    assert lines[0].startswith("native kernels unavailable (") and lines[0].endswith("; using torch ops")
    assert reason in lines[0]


# --- cache integrity -------------------------------------------------------------------------


@pytest.fixture
def stand_in_compiler(tmp_path, monkeypatch) -> Path:
    """CC: a script that 'builds' by copying the library this process already loaded, and
    counts its builds; FORNAX_HOME: an empty directory. Returns the count file."""
    lib = native._library()
    if lib is None:
        pytest.skip("no C compiler: the kernels cannot be built here")
    count = tmp_path / "builds"
    cc = tmp_path / "cc"
    cc.write_text(
        "#!/bin/sh\n"
        'while [ $# -gt 0 ]; do [ "$1" = -o ] && out="$2"; shift; done\n'
        f'echo built >> "{count}"\n'
        f'cp "{lib._name}" "$out"\n'
    )
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setenv("FORNAX_HOME", str(tmp_path / "home"))
    return count


def _builds(count: Path) -> int:
    return len(count.read_text().splitlines()) if count.exists() else 0


def _loads(path: Path, scratch: Path) -> bool:
    """Whether the file at `path` loads as the kernels. It is loaded from a copy under a new
    name: dlopen returns the handle it already has for a known path, and the test then writes
    over the file, which would pull pages from under a live mapping (SIGBUS)."""
    copy = scratch / f"load-{len(list(scratch.iterdir()))}.so"
    shutil.copy2(path, copy)
    try:
        return bool(ctypes.CDLL(str(copy)).paged_attention_f32)
    except OSError:
        return False


def test_cached_library_is_loaded_only_when_its_record_matches(stand_in_compiler, tmp_path):
    count = stand_in_compiler
    scratch = tmp_path / "loaded"
    scratch.mkdir()
    choice = isa.current()
    digest = native._source_digest(native.compile_flags(choice))
    target = native.library_path(digest, choice)
    record = native._record_path(target)
    target.parent.mkdir(parents=True)

    # A file at the library's name but no record (a stale build of an older fornax, or planted):
    # rebuilt, not loaded. The garbage itself would not load.
    target.write_bytes(b"not a shared object")
    assert not _loads(target, scratch)
    assert native._build(choice) == target and _builds(count) == 1 and _loads(target, scratch)
    assert record.read_text().startswith(f"sources {digest}\n")

    # The record vouches for the file: loaded as it is, no build.
    assert native._build(choice) == target and _builds(count) == 1

    # The library's bytes changed after its build (corrupted, replaced): rebuilt.
    target.write_bytes(b"garbage at the right name, beside a valid record")
    assert native._build(choice) == target and _builds(count) == 2 and _loads(target, scratch)

    # A record written for other sources (a full-digest mismatch behind a 16-digit name clash): rebuilt.
    record.write_text(record.read_text().replace(digest, "0" * len(digest)))
    assert native._build(choice) == target and _builds(count) == 3 and _loads(target, scratch)
    assert native._build(choice) == target and _builds(count) == 3


# --- index range checks ----------------------------------------------------------------------

# Each case calls a wrapper the way the engine does; prints {case: "ok" | exception name}.
INDEX_SCRIPT = """
    import json
    import torch
    from fornax.layers import native
    from fornax.layers.kv_pool import LayerKV

    assert native.DEBUG_CHECKS, "FORNAX_DEBUG=1 must switch the checks on"
    kernel = native.load_paged_attention()
    BLOCK, BLOCKS, HKV, D = 4, 3, 1, 16
    SLOTS = BLOCK * BLOCKS
    cache = LayerKV(torch.randn(SLOTS, HKV, D), torch.randn(SLOTS, HKV, D))
    int8_cache = LayerKV.allocate(SLOTS, HKV, D, torch.float32, "int8")
    i32 = lambda *v: torch.tensor(v, dtype=torch.int32)
    tables = i32([2, 0], [1, 0])  # two sequences of up to 2 blocks
    q = torch.randn(2, 2, D)

    def attend(block_tables=tables, row_seq=i32(0, 1), row_pos=i32(5, 2)):
        return kernel(q, cache, block_tables, row_seq, row_pos, BLOCK, 0.25, None)

    def write(slots):
        k = torch.randn(len(slots), HKV, D)
        return kernel.write_int8(int8_cache, torch.tensor(slots, dtype=torch.int64), k, k.clone())

    def rows(slots=(3, 9), block_tables=tables, row_seq=i32(0, 1), row_pos=i32(5, 2)):
        slots = torch.tensor(slots, dtype=torch.int64)
        return native.step_rows(slots, block_tables, row_seq, row_pos, 2, num_slots=SLOTS, block_size=BLOCK)

    cases = {
        "attention in range": lambda: attend().shape == (2, 2, D),
        "attention block id past the pool": lambda: attend(block_tables=i32([2, 10**6], [1, 0])),
        "attention negative block id": lambda: attend(block_tables=i32([2, 0], [-1, 0])),
        "attention row_seq past the tables": lambda: attend(row_seq=i32(0, 7)),
        "attention row_pos past the table width": lambda: attend(row_pos=i32(10**6, 2)),
        "attention negative row_pos": lambda: attend(row_pos=i32(5, -3)),
        "attention row maps shorter than the rows": lambda: attend(row_seq=i32(0), row_pos=i32(5)),
        "int8 write in range": lambda: write([0, SLOTS - 1]),
        "int8 write slot past the pool": lambda: write([0, 10**9]),
        "int8 write negative slot": lambda: write([-(10**9)]),
        "step rows in range": lambda: rows().rows == 2,
        "step rows slot past the pool": lambda: rows(slots=(3, SLOTS)),
        "step rows block id past the pool": lambda: rows(block_tables=i32([2, 0], [1, 3])),
        "step rows row_seq past the tables": lambda: rows(row_seq=i32(2, 0)),
    }
    results = {}
    for name, call in cases.items():
        try:
            got = call()
            results[name] = "ok" if got is True else f"returned {type(got).__name__}"
        except Exception as exc:
            results[name] = type(exc).__name__
        print(json.dumps({name: results[name]}), flush=True)  # what ran, should a case crash the process
"""


def test_out_of_range_indices_raise_before_c_in_debug_mode():
    if native.load_paged_attention() is None:
        pytest.skip("no C compiler: the kernels cannot be built here")
    proc = _run_python(INDEX_SCRIPT, _env(FORNAX_DEBUG="1"))  # the library this process built
    died = f"the child died (rc {proc.returncode}): a check is missing"
    assert proc.returncode == 0, f"{died}\n{proc.stdout}\n{proc.stderr}"
    results: dict[str, str] = {}
    for line in proc.stdout.splitlines():
        results.update(json.loads(line))
    assert len(results) == 14, proc.stdout
    for name, outcome in results.items():
        assert outcome == ("ok" if name.endswith("in range") else "IndexError"), (name, outcome)


def test_debug_checks_are_off_unless_asked(monkeypatch):
    """FORNAX_DEBUG decides; unset, the checks are off (the fallback children, started without
    it, assert that native.DEBUG_CHECKS is False)."""
    assert native.DEBUG_CHECKS is debug_checks_enabled()  # read once, at import
    for value, expected in ((None, False), ("", False), ("0", False), ("1", True), ("true", True)):
        if value is None:
            monkeypatch.delenv("FORNAX_DEBUG", raising=False)
        else:
            monkeypatch.setenv("FORNAX_DEBUG", value)
        assert debug_checks_enabled() is expected


def test_checks_name_the_argument():
    tables, zero = torch.zeros((1, 2), dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    with pytest.raises(IndexError, match="block_tables"):
        native.check_paged_indices(tables + 5, zero, zero, rows=1, num_slots=8, block_size=4)
    with pytest.raises(IndexError, match="slots"):
        native.check_slots(torch.tensor([8]), 1, 8)
    with pytest.raises(ValueError, match=r"slots must be a contiguous torch.int64"):
        native.check_slots(torch.tensor([1], dtype=torch.int32), 1, 8)
