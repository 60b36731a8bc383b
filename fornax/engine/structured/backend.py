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

from fornax.engine.structured.schema_check import UnsupportedSchemaError, check_schema, regex_problem
from fornax.engine.structured.spec import StructuredOutputsError, StructuredOutputsParams

if TYPE_CHECKING:
    import torch

    from fornax.tokenizer import Tokenizer

# Compiled grammars kept (by content). A JSON-schema grammar for this vocabulary is tens to
# hundreds of KiB; this bounds the cache to tens of MiB.
GRAMMAR_CACHE_SIZE = 256


class GrammarState:
    """One sequence's position in its grammar (an xgrammar GrammarMatcher)."""

    __slots__ = ("matcher",)

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher

    @property
    def terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted: nothing more may follow."""
        return bool(self.matcher.is_terminated())

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into bitmask row `row` (one bit per token id)."""
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def fill_drafts(self, bitmask: torch.Tensor, first_row: int, drafts: list[int]) -> None:
        """Rows first_row .. first_row + len(drafts): the masks after each prefix of the drafts.

        The matcher walks the drafts and comes back. A draft the grammar rejects ends the
        walk: the target gives it no probability at its row, so verification rejects it
        there and the rows after it are never read.
        """
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
        for token in tokens:
            if self.matcher.is_terminated():
                return  # the stop token was taken; the scheduler finishes the request
            if not self.matcher.accept_token(token):
                raise RuntimeError(f"token {token} is not allowed by the request's grammar")


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
                vocab, vocab_type=xgr.VocabType.RAW, vocab_size=self.vocab_size,
                stop_token_ids=sorted(tok.eos_token_ids),
            )  # fmt: skip
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

    def new_state(self, compiled: Any) -> GrammarState:
        import xgrammar as xgr

        return GrammarState(xgr.GrammarMatcher(compiled))

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
                return compiler.compile_json_schema(json.dumps(schema), any_whitespace=any_ws, strict_mode=True)
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
                return compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in params.choice))
            assert params.grammar is not None
            return compiler.compile_grammar(params.grammar)
        except UnsupportedSchemaError as exc:
            raise StructuredOutputsError(param, str(exc)) from None
        except StructuredOutputsError:
            raise
        except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError subclasses
            message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise StructuredOutputsError(param, f"cannot compile the {kind}: {message}") from None


def allocate_bitmask(num_rows: int, vocab_size: int) -> torch.Tensor:
    """[num_rows, ceil(vocab / 32)] int32, every bit set: rows nobody fills allow every token,
    so applying the whole mask leaves unconstrained rows bit-for-bit as they were."""
    import torch

    return torch.full((num_rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """logits [n, vocab] float32, in place: tokens whose bit is 0 become -inf (xgrammar's CPU
    kernel; on the whole batch it costs ~25 us for 16 rows, far less than with `indices`)."""
    import xgrammar as xgr

    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[-1])
