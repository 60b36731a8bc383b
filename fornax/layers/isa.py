"""Which instruction-set level the native kernels are built for (docs/kernels.md).

The kernels (layers/kernels/*.c) carry one path per level: AVX2 + FMA + F16C, AVX-512
(F/BW/VL/DQ), AVX-512 VNNI, AVX-512 BF16, AMX on x86; NEON, NEON with the dot product, NEON
with int8 matrix multiply on Arm. A level is a set of compiler flags: the library is compiled
once per level on first use (native.py), and each path is selected inside the sources by the
macros those flags define, so one set of sources serves every CPU and the choice is made at
run time from what the CPU reports (its /proc/cpuinfo flags), as ggml's per-variant CPU
backends do.

The CPU's own top level is built with -march=native, exactly as before levels existed;
FORNAX_ISA (config.env_isa) caps the level at a lower one the CPU also runs, built with the
generic flags below (-mtune=native keeps the scheduling of this CPU), so one machine tests and
measures every level it can run. A cap above the CPU is refused: the library would die on an
illegal instruction.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass
from pathlib import Path

from fornax.config import ConfigError, env_isa


@dataclass(frozen=True)
class Level:
    name: str
    requires: frozenset[str]  # CPU flags (/proc/cpuinfo names) the level needs
    flags: tuple[str, ...]  # compiler flags for a capped build (the top level uses -march=native)
    summary: str  # what the kernels then use, for the start-up line


def _level(name: str, requires: str, flags: str, summary: str) -> Level:
    return Level(name, frozenset(requires.split()), tuple(flags.split()), summary)


_AVX2 = "avx2 fma f16c"
_AVX512 = _AVX2 + " avx512f avx512bw avx512vl avx512dq"
X86_LEVELS = (
    _level("avx2", _AVX2, "-march=x86-64-v3 -mtune=native", "avx2+fma"),
    _level("avx512", _AVX512, "-march=x86-64-v4 -mtune=native", "avx512"),
    _level(
        "avx512-vnni", _AVX512 + " avx512_vnni", "-march=x86-64-v4 -mavx512vnni -mtune=native", "avx512+vnni"
    ),
    _level(
        "avx512-bf16",
        _AVX512 + " avx512_vnni avx512_bf16",
        "-march=x86-64-v4 -mavx512vnni -mavx512bf16 -mtune=native",
        "avx512+vnni+bf16",
    ),
    _level(
        "amx",
        _AVX512 + " avx512_vnni avx512_bf16 amx_tile amx_bf16 amx_int8",
        "-march=x86-64-v4 -mavx512vnni -mavx512bf16 -mamx-tile -mamx-bf16 -mamx-int8 -mtune=native",
        "amx+avx512",
    ),
)
ARM_LEVELS = (
    _level("neon", "asimd", "-march=armv8-a", "neon"),
    _level("neon-dotprod", "asimd asimddp", "-march=armv8.2-a+dotprod", "neon+dotprod"),
    _level("neon-i8mm", "asimd asimddp i8mm", "-march=armv8.2-a+dotprod+i8mm", "neon+dotprod+i8mm"),
)
LEVELS = {level.name: level for level in X86_LEVELS + ARM_LEVELS}


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """The CPU's feature flags: x86's "flags" line or Arm's "Features" line of /proc/cpuinfo."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return frozenset()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def _family(machine: str | None) -> tuple[Level, ...]:
    """The levels of this machine's architecture (x86 or Arm), lowest first."""
    return ARM_LEVELS if (machine or platform.machine()) in ("aarch64", "arm64") else X86_LEVELS


def supported_levels(flags: frozenset[str], machine: str | None = None) -> tuple[Level, ...]:
    """The levels this CPU runs, lowest first (empty: none of the kernels' paths fits it)."""
    return tuple(level for level in _family(machine) if level.requires <= flags)


@dataclass(frozen=True)
class Choice:
    """The level the kernels are built for, and how: `native` (-march=native, the CPU's own top
    level) or the level's generic flags (a FORNAX_ISA cap below the top)."""

    level: Level | None  # None: the CPU runs none of the levels (the kernels' scalar loops only)
    native: bool

    @property
    def name(self) -> str:
        return self.level.name if self.level else "scalar"

    @property
    def compile_flags(self) -> tuple[str, ...]:
        return ("-march=native",) if self.native or self.level is None else self.level.flags


def choose(cap: str | None, flags: frozenset[str], machine: str | None = None) -> Choice:
    """The level for a cap (None: the CPU's top). ConfigError for an unknown name or a level
    this CPU cannot run."""
    levels = supported_levels(flags, machine)
    if cap is None:
        return Choice(levels[-1] if levels else None, native=True)
    if cap not in LEVELS:
        raise ConfigError(f"FORNAX_ISA={cap!r} is not a level; known: {', '.join(LEVELS)}")
    names = [level.name for level in levels]
    if cap not in names:
        runs = ", ".join(names) or "none of them"
        raise ConfigError(f"FORNAX_ISA={cap!r}: this CPU cannot run that level (it runs {runs})")
    return Choice(LEVELS[cap], native=cap == names[-1])


def current() -> Choice:
    """The choice for this process: FORNAX_ISA against this CPU."""
    return choose(env_isa(), cpu_flags())


def level_flags(choice: Choice, flags: frozenset[str], machine: str | None = None) -> frozenset[str]:
    """The CPU's flags as a process capped at `choice` may use them: without the flags that only
    the levels above it add. A process capped below AVX-512 BF16 then plans as a CPU of its level
    would (float32 activations, no bf16 step left to torch), so that the cap measures that CPU."""
    if choice.native or choice.level is None:
        return flags
    above = frozenset().union(*(level.requires for level in _family(machine))) - choice.level.requires
    return flags - above


def usable_flags() -> frozenset[str]:
    """level_flags for this process: the CPU's flags under its FORNAX_ISA cap."""
    flags = cpu_flags()
    return level_flags(choose(env_isa(), flags), flags)
