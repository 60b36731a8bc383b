"""Tokenizer fixtures shared by the tokenizer and chat-template tests (loaded once per session)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from fornax.tokenizer import Tokenizer
from tests.hf_reference import one_gguf_parse


@pytest.fixture(scope="session")
def reference(default_gguf: Path) -> Any:
    """transformers' tokenizer for the same GGUF: the reference implementation."""
    transformers = pytest.importorskip("transformers")
    with one_gguf_parse():
        return transformers.AutoTokenizer.from_pretrained(
            str(default_gguf.parent), gguf_file=default_gguf.name
        )


@pytest.fixture(scope="session")
def ours(default_gguf: Path) -> Tokenizer:
    return Tokenizer.from_gguf_file(default_gguf)
