"""The two grammar engines set up on a fornax tokenizer, as the structured-output tests and
benchmarks/grammar_engines.py use them (xgrammar and llguidance are imported lazily: neither is a
fornax dependency yet).

Special tokens: xgrammar's TokenizerInfo has no special-token argument; it treats a token as
special (never allowed by a grammar) only when its bytes are empty. Given the raw text of
SmolLM2's control tokens ("<|im_start|>", "<|endoftext|>", ...), it lets the model write them
inside JSON strings, so the xgrammar vocabulary blanks every special token that is not a stop
token. llguidance takes the special ids directly and never allows them unless a grammar names them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fornax.tokenizer import Tokenizer


@dataclass
class Vocab:
    """What both engines are built from: a tokenizer's raw token bytes and its special ids."""

    tokenizer: Tokenizer
    size: int
    token_bytes: list[bytes]  # raw bytes of every id, special tokens as their text
    stop_ids: list[int]  # the ids that end generation (EOS and end-of-turn)
    special_ids: list[int]

    @classmethod
    def from_tokenizer(cls, tok: Tokenizer) -> Vocab:
        size = tok.vocab_size
        return cls(
            tok,
            size,
            [tok.token_bytes(i) for i in range(size)],
            sorted(tok.eos_token_ids),
            sorted(tok.all_special_ids),
        )

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def xgrammar_vocab(self) -> list[bytes]:
        """Token bytes with every non-stop special token blanked (see the module docstring)."""
        blank = set(self.special_ids) - set(self.stop_ids)
        return [b"" if i in blank else b for i, b in enumerate(self.token_bytes)]


def xgrammar_tokenizer_info(v: Vocab) -> Any:
    import xgrammar as xgr

    return xgr.TokenizerInfo(
        v.xgrammar_vocab(), vocab_type=xgr.VocabType.RAW, vocab_size=v.size, stop_token_ids=v.stop_ids
    )


class _LLGuidanceSource:
    """The object llguidance.TokenizerWrapper reads: ids, token bytes, and bytes -> ids."""

    def __init__(self, v: Vocab) -> None:
        self.eos_token_id = v.stop_ids[0] if v.tokenizer.eos_token_id is None else v.tokenizer.eos_token_id
        self.bos_token_id = v.tokenizer.bos_token_id
        self.tokens = v.token_bytes
        self.special_token_ids = v.special_ids
        self._v = v

    def __call__(self, data: bytes) -> list[int]:
        return self._v.encode(data.decode(errors="replace"))


def llguidance_tokenizer(v: Vocab) -> Any:
    import llguidance

    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_LLGuidanceSource(v)))


def _allowed(bitmask: Any, token: int) -> bool:
    return bool((int(bitmask[0, token // 32]) >> (token % 32)) & 1)


def xgrammar_accepts(compiled: Any, v: Vocab, text: str) -> bool:
    """Whether xgrammar lets `text` be generated: every token of it allowed by the mask and
    accepted in turn, then a stop token allowed and accepted."""
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, v.size)
    for token in [*v.encode(text), v.stop_ids[0]]:
        matcher.fill_next_token_bitmask(bitmask)
        if not _allowed(bitmask, token) or not matcher.accept_token(token):
            return False
    return matcher.is_terminated()


def llguidance_accepts(lltok: Any, grammar: str, v: Vocab) -> Any:
    """A function text -> bool: whether llguidance lets `text` be generated, token by token,
    then EOS. Raises ValueError when the grammar does not build."""
    import llguidance
    import llguidance.torch

    probe = llguidance.LLMatcher(lltok, grammar, log_level=0)
    if probe.is_error():
        raise ValueError(probe.get_error())
    eos = _LLGuidanceSource(v).eos_token_id

    def accepts(text: str) -> bool:
        matcher = llguidance.LLMatcher(lltok, grammar, log_level=0)
        bitmask = llguidance.torch.allocate_token_bitmask(1, v.size)
        for token in v.encode(text):
            llguidance.torch.fill_next_token_bitmask(matcher, bitmask)
            if not _allowed(bitmask, token) or not matcher.consume_token(token):
                return False
        llguidance.torch.fill_next_token_bitmask(matcher, bitmask)
        if not (_allowed(bitmask, eos) and matcher.is_accepting() and matcher.consume_token(eos)):
            return False
        return not matcher.is_error()

    return accepts
