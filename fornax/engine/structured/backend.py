"""Grammars for constrained decoding, on xgrammar (chosen over llguidance by measurement on the
default model's vocabulary: benchmarks/grammar_engines.py, docs/structured-outputs.md).

`GrammarBackend` turns a StructuredOutputsParams into a compiled grammar (cached by content,
thread-safe: the server compiles in worker threads before the engine sees the request) and
hands out one `GrammarState` per generated sequence. A GrammarState follows the sequence's
accepted output tokens; the engine thread advances it after each step and the mask thread
reads it during the next step's forward (never both at once: the step waits for the masks
before it accepts tokens).

xgrammar is imported on first use: it costs seconds to import and most servers never need it.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from fornax.engine.structured.schema_check import UnsupportedSchemaError, check_schema, regex_problem
from fornax.engine.structured.spec import StructuredOutputsError, StructuredOutputsParams

if TYPE_CHECKING:
    from fornax.tokenizer import Tokenizer

# Compiled grammars kept (by content). A JSON-schema grammar for this vocabulary is tens to
# hundreds of KiB; this bounds the cache to tens of MiB.
GRAMMAR_CACHE_SIZE = 256


class GrammarState:
    """One sequence's position in its grammar (an xgrammar GrammarMatcher).

    With a `gate` (the token ids of a reasoning model's `</think>`), the grammar starts only
    after the output has taken those tokens: the reasoning before them is free text, and the
    constraint holds for the answer (docs/structured-outputs.md).
    """

    __slots__ = ("_gate", "_tail", "matcher", "vocab_size")

    def __init__(self, matcher: Any, vocab_size: int, gate: tuple[int, ...] = ()) -> None:
        self.matcher, self.vocab_size = matcher, vocab_size
        self._gate = gate  # () once the grammar holds
        self._tail: list[int] = []  # the last output tokens, while the gate is awaited

    @property
    def gated(self) -> bool:
        """The output has not reached the point where the grammar starts."""
        return bool(self._gate)

    @property
    def terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted: nothing more may follow."""
        return not self._gate and bool(self.matcher.is_terminated())

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into bitmask row `row` (one bit per token id)."""
        if self._gate:
            bitmask[row].fill_(-1)  # every token: the reasoning is free
        else:
            self.matcher.fill_next_token_bitmask(bitmask, row)

    def fill_drafts(self, bitmask: torch.Tensor, first_row: int, drafts: list[int]) -> None:
        """Rows first_row .. first_row + len(drafts): the masks after each prefix of the drafts.

        The matcher walks the drafts and comes back. A draft the grammar rejects ends the
        walk: the target gives it no probability at its row, so verification rejects it
        there and the rows after it are never read. While gated, rows are free up to the
        draft that completes the gate, and the grammar's rows follow it.
        """
        if self._gate:
            tail = self._tail[:]
            for j, token in enumerate(drafts):
                bitmask[first_row + j].fill_(-1)
                tail.append(token)
                if tail[-len(self._gate) :] == list(self._gate):
                    self._fill_walk(bitmask, first_row + j + 1, drafts[j + 1 :])
                    return
            bitmask[first_row + len(drafts)].fill_(-1)
            return
        self._fill_walk(bitmask, first_row, drafts)

    def _fill_walk(self, bitmask: torch.Tensor, first_row: int, drafts: list[int]) -> None:
        walked = 0
        for j, token in enumerate(drafts):
            self.matcher.fill_next_token_bitmask(bitmask, first_row + j)
            if self.matcher.is_terminated() or not self.matcher.accept_token(token):
                break
            walked += 1
        else:
            self.matcher.fill_next_token_bitmask(bitmask, first_row + len(drafts))
        if walked:
            self.matcher.rollback(walked)

    def accept(self, tokens: list[int]) -> None:
        """Advance past tokens the sequence took. A token outside the grammar means the mask
        was not applied to its row: a bug that must end the request, not bend its output."""
        if self._gate:
            tokens = self._pass_gate(tokens)
        for token in tokens:
            if self.matcher.is_terminated():
                return  # the stop token was taken; the scheduler finishes the request
            if not self.matcher.accept_token(token):
                if self._dead_end():
                    raise StructuredOutputsError(
                        "structured_outputs",
                        "the constraint cannot be met with this model's vocabulary: no token continues it "
                        "here (it asks for a character the vocabulary cannot produce)",
                    )
                raise RuntimeError(f"token {token} is not allowed by the request's grammar")

    def _pass_gate(self, tokens: list[int]) -> list[int]:
        """Look for the gate in the output; returns the tokens after it (none while gated)."""
        gate = list(self._gate)
        for i, token in enumerate(tokens):
            self._tail.append(token)
            if self._tail[-len(gate) :] == gate:
                self._gate, self._tail = (), []
                return tokens[i + 1 :]
        del self._tail[: -len(gate)]
        return []

    def _dead_end(self) -> bool:
        """No token at all is allowed next: the sampler had nothing to choose from. A grammar
        (a regex's unassigned code point, say) may need bytes this vocabulary has no token for,
        which only shows when generation gets there."""
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)
        self.matcher.fill_next_token_bitmask(bitmask, 0)
        return not bool(bitmask.any())


class GrammarBackend:
    """Compiles and caches grammars for one tokenizer and vocabulary size."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self._lock = threading.Lock()
        self._compiler: Any = None
        self._cache: OrderedDict[tuple[str, str, bool], Any] = OrderedDict()
        self.num_compiled = 0  # cache misses, for tests and metrics

    def _get_compiler(self) -> Any:
        if self._compiler is None:
            import xgrammar as xgr

            tok = self.tokenizer
            specials = set(tok.all_special_ids)
            # Special tokens (and ids past the tokenizer, the model's padding rows) get no text:
            # xgrammar then never allows them inside the output's text. EOS stays a stop token.
            vocab = [b"" if i in specials else tok.token_bytes(i) for i in range(tok.vocab_size)]
            vocab += [b""] * (self.vocab_size - len(vocab))
            info = xgr.TokenizerInfo(
                vocab,
                vocab_type=xgr.VocabType.RAW,
                vocab_size=self.vocab_size,
                stop_token_ids=sorted(tok.eos_token_ids),
            )
            self._compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        return self._compiler

    def compile(self, params: StructuredOutputsParams) -> Any:
        """The compiled grammar for `params`; raises StructuredOutputsError (a 400) when the
        request asks for something the grammar engine cannot enforce or cannot parse."""
        key = params.cache_key()
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                return compiled
            compiled = self._compile(params)
            self.num_compiled += 1
            self._cache[key] = compiled
            if len(self._cache) > GRAMMAR_CACHE_SIZE:
                self._cache.popitem(last=False)
            return compiled

    def new_state(self, compiled: Any, gate: tuple[int, ...] = ()) -> GrammarState:
        import xgrammar as xgr

        return GrammarState(xgr.GrammarMatcher(compiled), self.vocab_size, gate)

    def _compile(self, params: StructuredOutputsParams) -> Any:
        compiler = self._get_compiler()
        kind = params.kind
        param = params.param_for(kind)
        any_ws = not params.disable_any_whitespace
        try:
            if kind == "json":
                schema = params.json
                if schema is False:
                    raise StructuredOutputsError(param, "the schema `false` matches nothing")
                schema = {} if schema is True else schema
                check_schema(schema)
                return compiler.compile_json_schema(
                    json.dumps(schema), any_whitespace=any_ws, strict_mode=True
                )
            if kind == "json_object":
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=any_ws)
            if kind == "regex":
                assert params.regex is not None
                problem = regex_problem(params.regex)  # what xgrammar would read other than as written
                if problem is not None:
                    raise StructuredOutputsError(param, f"the regex cannot be enforced: {problem}")
                return compiler.compile_regex(params.regex)
            if kind == "choice":
                assert params.choice is not None
                # Each choice as an EBNF string literal; JSON's escapes are also EBNF's.
                return compiler.compile_grammar(
                    "root ::= " + " | ".join(json.dumps(c) for c in params.choice)
                )
            assert params.grammar is not None
            return compiler.compile_grammar(params.grammar)
        except UnsupportedSchemaError as exc:
            raise StructuredOutputsError(param, str(exc)) from None
        except StructuredOutputsError:
            raise
        except Exception as exc:
            message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise StructuredOutputsError(param, f"cannot compile the {kind}: {message}") from None


def allocate_bitmask(num_rows: int, vocab_size: int) -> torch.Tensor:
    """[num_rows, ceil(vocab / 32)] int32 with every bit set (every token allowed). Made by
    numpy: the mask thread then runs no torch kernel that could wake torch's thread pool
    while the forward has the cores."""
    return torch.from_numpy(np.full((num_rows, (vocab_size + 31) // 32), -1, dtype=np.int32))


# For each byte value, 0.0 where its bit is set and -inf where not, bit 0 first: the order
# xgrammar packs token ids in (token 32 * w + b is bit b of int32 word w, little-endian).
_BYTE_BITS = (torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1  # [256, 8]
_BYTE_BIAS = torch.zeros(256, 8).masked_fill_(_BYTE_BITS == 0, float("-inf")).numpy()  # [256, 8] float32


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """logits [n, vocab] float32, in place: in rows `rows` [r] (with bitmask [r, vocab / 32]),
    tokens whose bit is 0 become -inf; other rows are not touched at all.

    The bits become an additive 0 / -inf bias by looking each mask byte up in a 256-entry
    table (numpy's take: one vectorised gather, no thread pool to wake). A masked_fill with
    the unpacked boolean mask, and xgrammar's own CPU kernel, both took ~2 ms for 16 rows of
    this vocabulary on this CPU; the gather takes ~0.15 ms and torch's embedding as the
    gather ~0.25 ms, 30 us and 15 us for one row (2026-12-04).
    """
    num_rows, vocab = rows.shape[0], logits.shape[-1]
    mask_bytes = bitmask.numpy().view(np.uint8)  # [r, vocab / 8]
    bias = torch.from_numpy(np.take(_BYTE_BIAS, mask_bytes, axis=0)).view(num_rows, -1)[
        :, :vocab
    ]  # [r, vocab]
    logits.index_add_(0, rows, bias)
