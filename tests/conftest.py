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
