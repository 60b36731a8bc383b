"""A constraint that starts after the reasoning (engine/structured/backend.py, GrammarState's
gate): free tokens until the output has taken `</think>`, the grammar's from there on, in plain
steps and in the rows speculative decoding verifies."""

from __future__ import annotations

import pytest
import torch

from fornax.engine.structured.spec import StructuredOutputsParams
from tests.model.tiny_models import TINY_VOCAB, make_tokenizer_files

xgr = pytest.importorskip("xgrammar")


@pytest.fixture(scope="module")
def backend_and_tokenizer(tmp_path_factory):
    from fornax.engine.structured.backend import GrammarBackend
    from fornax.tokenizer import Tokenizer

    out = tmp_path_factory.mktemp("think-tokenizer")
    make_tokenizer_files(out, added_tokens=("<think>", "</think>"))
    tok = Tokenizer.from_pretrained_dir(out)
    return GrammarBackend(tok, TINY_VOCAB), tok


def _allowed(bitmask: torch.Tensor, row: int) -> set[int]:
    words = bitmask[row].tolist()
    return {i for i in range(TINY_VOCAB) if (words[i // 32] >> (i % 32)) & 1}


def _digit_tokens(tok) -> set[int]:
    return {i for i in range(TINY_VOCAB) if (t := tok.token_bytes(i)) and t.isdigit()}


def _state(backend_and_tokenizer):
    backend, tok = backend_and_tokenizer
    compiled = backend.compile(StructuredOutputsParams(regex="[0-9]{1,4}"))
    gate = tuple(tok.encode("</think>", False))
    assert len(gate) == 1  # an added token, as in Qwen3's vocabulary
    return backend.new_state(compiled, gate), tok, gate


def test_free_until_the_gate_then_the_grammar(backend_and_tokenizer) -> None:
    state, tok, gate = _state(backend_and_tokenizer)
    bitmask = xgr.allocate_token_bitmask(1, TINY_VOCAB)
    bitmask.zero_()
    state.fill(bitmask, 0)
    assert _allowed(bitmask, 0) == set(range(TINY_VOCAB))  # the thinking is free
    state.accept(tok.encode("<think>The quick brown fox", False))  # letters: no grammar yet
    assert state.gated and not state.terminated
    state.accept([*gate, *tok.encode("12", False)])  # the gate and the answer's first digits in one step
    assert not state.gated
    state.fill(bitmask, 0)
    allowed = _allowed(bitmask, 0)
    assert allowed and allowed <= _digit_tokens(tok) | set(tok.eos_token_ids)
    with pytest.raises(RuntimeError, match="not allowed"):
        state.accept(tok.encode("fox", False))


def test_draft_rows_follow_the_gate_inside_the_drafts(backend_and_tokenizer) -> None:
    state, tok, gate = _state(backend_and_tokenizer)
    letter = tok.encode("a", False)[0]
    one = tok.encode("1", False)[0]
    drafts = [letter, gate[0], one]
    bitmask = xgr.allocate_token_bitmask(len(drafts) + 1, TINY_VOCAB)
    bitmask.zero_()
    state.fill_drafts(bitmask, 0, drafts)
    everything = set(range(TINY_VOCAB))
    assert _allowed(bitmask, 0) == everything and _allowed(bitmask, 1) == everything  # before, at the gate
    digits = _digit_tokens(tok)
    assert one in _allowed(bitmask, 2) and _allowed(bitmask, 2) <= digits  # the grammar's first row
    assert letter not in _allowed(bitmask, 3)
    assert state.gated  # filling masks moved nothing: the step accepts what it verified
    state.accept(drafts)
    assert not state.gated


def test_without_a_gate_the_grammar_holds_from_the_first_token(backend_and_tokenizer) -> None:
    backend, tok = backend_and_tokenizer
    state = backend.new_state(backend.compile(StructuredOutputsParams(regex="[0-9]{1,4}")))
    bitmask = xgr.allocate_token_bitmask(1, TINY_VOCAB)
    state.fill(bitmask, 0)
    assert _allowed(bitmask, 0) <= _digit_tokens(tok) | set(tok.eos_token_ids)
