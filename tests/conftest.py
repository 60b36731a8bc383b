"""Shared fixtures. The default model is fetched once (cached under FORNAX_HOME)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def default_gguf() -> Path:
    """Path of the default model's GGUF file (SmolLM2-135M-Instruct Q4_1)."""
    override = os.environ.get("FORNAX_TEST_GGUF")
    if override:
        return Path(override)
    from fornax.models.registry import resolve_model

    return resolve_model("smollm2-135m-instruct").gguf_path


@pytest.fixture(scope="session")
def gemma3_gguf() -> Path:
    """Path of Gemma 3 270M's Q4_K_M GGUF (the gemma3-270m alias: four PyPI parts, joined)."""
    from fornax.models.registry import resolve_model

    return resolve_model("gemma3-270m").gguf_path


@pytest.fixture(autouse=True)
def _restore_torch_threads():
    """Building an engine sets torch's process-wide thread count (a tensor-parallel rank takes
    its share of the cores, `num_threads=1` one): put it back after each test, so that no test
    leaves the rest of the suite on fewer threads."""
    import torch

    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


# The longest test files (seconds on 2 cores, `--durations`), started first: `make test` hands
# whole files to its pytest-xdist workers in collection order, and a long file started last
# keeps one worker busy while the other idles. Only the order changes, never what runs.
LONGEST_FIRST = (
    "tests/model/test_deterministic.py",
    "tests/spec_decode/test_default_model.py",
    "tests/model/test_tensor_parallel_engine.py",
    "tests/model/test_gemma3_gguf.py",
    "tests/server/test_multi_model.py",
    "tests/cluster/test_ray_cluster.py",
    "tests/server/test_concurrency.py",
    "tests/server/test_structured_outputs.py",
    "tests/engine/test_batching.py",
    "tests/model/test_default_model.py",
    "tests/kv/test_tiered_engine.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    root = Path(str(config.rootpath))
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}

    def key(item: pytest.Item) -> int:
        return rank.get(Path(str(item.path)).relative_to(root).as_posix(), len(LONGEST_FIRST))

    items.sort(key=key)  # stable: within a file, and among the rest, the collected order stays
