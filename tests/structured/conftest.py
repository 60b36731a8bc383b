"""Fixtures shared by tests/structured: the default model's vocabulary and both grammar engines
built on it (once per session; the tests skip when an engine is not installed)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.structured.engines import Vocab, llguidance_tokenizer, xgrammar_tokenizer_info


@pytest.fixture(scope="session")
def vocab(default_gguf) -> Vocab:
    from fornax.tokenizer import Tokenizer

    return Vocab.from_tokenizer(Tokenizer.from_gguf_file(default_gguf))


@pytest.fixture(scope="session")
def xgr_compiler(vocab: Vocab) -> Any:
    xgr = pytest.importorskip("xgrammar")
    return xgr.GrammarCompiler(xgrammar_tokenizer_info(vocab), max_threads=1, cache_enabled=False)


@pytest.fixture(scope="session")
def llg_tokenizer(vocab: Vocab) -> Any:
    pytest.importorskip("llguidance")
    pytest.importorskip("torch")
    return llguidance_tokenizer(vocab)
