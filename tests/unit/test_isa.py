"""The instruction-set levels (layers/isa.py) and dtype "auto" (layers/kernel_plan.py),
without building or loading anything."""

from __future__ import annotations

import pytest

from fornax.config import ConfigError
from fornax.layers import isa
from fornax.layers.kernel_plan import choose_dtype

ZEN2 = frozenset("fpu sse2 avx avx2 fma f16c bmi2".split())
ZEN4 = ZEN2 | frozenset("avx512f avx512bw avx512vl avx512dq avx512_vnni avx512_bf16".split())
SAPPHIRE = ZEN4 | frozenset("amx_tile amx_bf16 amx_int8".split())
GRAVITON3 = frozenset("fp asimd asimddp i8mm sve".split())


def test_cpuinfo_flags_are_read_on_x86_and_arm():
    x86 = "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu avx2 fma\n"
    arm = "processor\t: 0\nFeatures\t: fp asimd asimddp\nCPU part\t: 0xd40\n"
    assert isa.cpu_flags(x86) == {"fpu", "avx2", "fma"}
    assert isa.cpu_flags(arm) == {"fp", "asimd", "asimddp"}
    assert isa.cpu_flags("") == frozenset()


@pytest.mark.parametrize(
    "flags,machine,levels",
    [
        (ZEN2, "x86_64", ["avx2"]),
        (ZEN4, "x86_64", ["avx2", "avx512", "avx512-vnni", "avx512-bf16"]),
        (SAPPHIRE, "x86_64", ["avx2", "avx512", "avx512-vnni", "avx512-bf16", "amx"]),
        (frozenset({"sse2", "avx"}), "x86_64", []),
        (GRAVITON3, "aarch64", ["neon", "neon-dotprod", "neon-i8mm"]),
        (frozenset({"fp", "asimd"}), "aarch64", ["neon"]),
    ],
)
def test_levels_follow_the_flags(flags, machine, levels):
    assert [level.name for level in isa.supported_levels(flags, machine)] == levels


def test_the_top_level_is_built_native_and_a_cap_with_generic_flags():
    top = isa.choose(None, SAPPHIRE, "x86_64")
    assert top.name == "amx" and top.native and top.compile_flags == ("-march=native",)
    capped = isa.choose("avx2", SAPPHIRE, "x86_64")
    assert capped.name == "avx2" and not capped.native
    assert "-march=x86-64-v3" in capped.compile_flags and "-march=native" not in capped.compile_flags
    vnni = isa.choose("avx512-vnni", SAPPHIRE, "x86_64").compile_flags
    assert "-mavx512vnni" in vnni and "-mavx512bf16" not in vnni and not any("amx" in f for f in vnni)
    # a cap at the CPU's own top level is the native build itself
    assert isa.choose("avx2", ZEN2, "x86_64").native
    assert isa.choose("neon-dotprod", GRAVITON3, "aarch64").compile_flags == ("-march=armv8.2-a+dotprod",)


def test_a_cap_the_cpu_cannot_run_or_an_unknown_name_is_refused():
    with pytest.raises(ConfigError, match="cannot run"):
        isa.choose("avx512", ZEN2, "x86_64")
    with pytest.raises(ConfigError, match="not a level"):
        isa.choose("sse9", ZEN2, "x86_64")
    assert isa.choose(None, frozenset(), "x86_64").name == "scalar"


def test_current_reads_fornax_isa(monkeypatch):
    here = isa.supported_levels(isa.cpu_flags())
    if not here:
        pytest.skip("this CPU runs none of the levels")
    monkeypatch.setenv("FORNAX_ISA", here[0].name)
    assert isa.current().name == here[0].name
    monkeypatch.setenv("FORNAX_ISA", "no-such-level")
    with pytest.raises(ConfigError):
        isa.current()


def test_a_capped_process_sees_only_its_levels_flags():
    """Under a cap the plan must see the CPU a real CPU of that level is: no native bf16 for torch
    below avx512-bf16 (kernel_plan.Kernels.torch_bf16 reads these flags), no AMX below amx."""
    avx2 = isa.level_flags(isa.choose("avx2", SAPPHIRE, "x86_64"), SAPPHIRE, "x86_64")
    assert avx2 == ZEN2  # every AVX-512 and AMX flag gone, the CPU's other flags kept
    vnni = isa.level_flags(isa.choose("avx512-vnni", SAPPHIRE, "x86_64"), SAPPHIRE, "x86_64")
    assert "avx512_vnni" in vnni and not vnni & {"avx512_bf16", "amx_bf16", "amx_tile", "amx_int8"}
    bf16 = isa.level_flags(isa.choose("avx512-bf16", SAPPHIRE, "x86_64"), SAPPHIRE, "x86_64")
    assert bf16 == ZEN4
    assert isa.level_flags(isa.choose(None, SAPPHIRE, "x86_64"), SAPPHIRE, "x86_64") == SAPPHIRE
    neon = isa.level_flags(isa.choose("neon", GRAVITON3, "aarch64"), GRAVITON3, "aarch64")
    assert neon == {"fp", "asimd", "sve"}


def test_auto_dtype_is_float32_only_where_bf16_would_be_emulated():
    assert choose_dtype(True, ZEN2) == "bfloat16"  # the kernels widen bf16 themselves
    assert choose_dtype(False, ZEN2) == "float32"  # torch alone would emulate bf16
    assert choose_dtype(False, ZEN4) == "bfloat16"  # AVX-512 BF16: torch's bf16 is native
    assert choose_dtype(False, SAPPHIRE) == "bfloat16"


def test_auto_dtype_resolves_per_backend_and_cpu(monkeypatch, caplog):
    """EngineArgs' dtype "auto" becomes a concrete dtype in the engine config: float32, with one
    warning, where neither fornax's kernels nor the CPU compute bf16."""
    from fornax.engine_args import EngineArgs
    from fornax.layers import kernel_plan

    monkeypatch.setattr(kernel_plan.isa, "cpu_flags", lambda: ZEN2)
    with caplog.at_level("WARNING", logger="fornax.kernels"):
        config = EngineArgs(model="m", kernel_backend="torch").create_engine_config()
    assert config.dtype == "float32" and "dtype auto -> float32" in caplog.text
    monkeypatch.setattr(kernel_plan.isa, "cpu_flags", lambda: SAPPHIRE)
    assert EngineArgs(model="m", kernel_backend="torch").create_engine_config().dtype == "bfloat16"
    assert EngineArgs(model="m", dtype="float32").create_engine_config().dtype == "float32"


def test_w8a8_small_steps_take_int4_longer_where_int8_has_no_byte_dot_product():
    from fornax.config import SMALL_STEP_MAX_ROWS_W8A8
    from fornax.layers.kernel_plan import w8a8_small_step_rows

    assert w8a8_small_step_rows("avx2") == w8a8_small_step_rows("avx512") == 4
    for level in ("avx512-vnni", "avx512-bf16", "amx", "neon", "neon-dotprod", "neon-i8mm", None):
        assert w8a8_small_step_rows(level) == SMALL_STEP_MAX_ROWS_W8A8


def test_engine_args_pick_the_w8a8_small_rows_of_the_capped_level(monkeypatch):
    """make run's flags leave small_step_max_rows unset: it follows the kernels' level; a value
    given is kept, and without w8a8 EngineConfig's own default applies."""
    from fornax.config import SMALL_STEP_MAX_ROWS
    from fornax.engine_args import EngineArgs
    from fornax.layers import native

    level = isa.choose("avx2", ZEN4, "x86_64")
    monkeypatch.setattr(native, "library_level", lambda: level)
    make_run = EngineArgs(model="m", quantization="auto", large_step_quantization="w8a8", dtype="bfloat16")
    assert make_run.create_engine_config().small_step_max_rows == 4
    given = EngineArgs(model="m", large_step_quantization="w8a8", small_step_max_rows=2, dtype="bfloat16")
    assert given.create_engine_config().small_step_max_rows == 2
    assert (
        EngineArgs(model="m", dtype="bfloat16").create_engine_config().small_step_max_rows
        == SMALL_STEP_MAX_ROWS
    )
    monkeypatch.setattr(native, "library_level", lambda: isa.choose(None, ZEN4, "x86_64"))
    assert make_run.create_engine_config().small_step_max_rows == 1
