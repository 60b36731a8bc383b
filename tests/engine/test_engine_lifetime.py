"""A dropped engine gives its memory back at once: nothing in the runner refers back to itself,
so its KV pools (gigabytes at default sizes) are freed by reference counting, not whenever the
cycle collector next runs. A suite that builds many engines in one process relies on it: a
cycle here once held ~8 GB per test worker until the OOM killer ended one."""

from __future__ import annotations

import gc
import weakref

from fornax import LLM


def test_a_dropped_engine_frees_its_runner_without_the_cycle_collector(default_gguf) -> None:
    gc.collect()
    gc.disable()
    try:
        llm = LLM(str(default_gguf), num_blocks=16, progress=False)
        runner, kv = weakref.ref(llm.engine.runner), weakref.ref(llm.engine.runner.kv_cache)
        del llm
        assert runner() is None and kv() is None
    finally:
        gc.enable()
