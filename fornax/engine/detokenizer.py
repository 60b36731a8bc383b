"""Incremental, UTF-8 safe detokenization and stop strings, one request at a time.

Decoding token by token in isolation is wrong twice over: byte-level and byte-fallback
tokenizers split one emoji or CJK character over several tokens (each alone decodes to
'\ufffd'), and SentencePiece-style tokenizers render a token's leading space only after
another token. So each step decodes a short window: the tokens already shown ("prefix")
plus the unread ones, and emits only the text beyond the prefix's text. While that text
ends in '\ufffd' the unread tokens wait for the rest of their character. The window is
cut back after each emission, so a step costs O(window), not O(output).

Stop strings are searched in the newly decoded text plus the last (longest stop - 1)
characters before it, which finds a stop string split across tokens. `get_next_delta`
holds those characters back from streaming until the request ends, so a stop string is
never half-streamed and then retracted.
"""

from __future__ import annotations

from typing import Protocol

from fornax.engine.request import SamplingParams

# Prompt tokens that seed the window, giving the first generated token its left context.
PROMPT_CONTEXT_TOKENS = 5
# One UTF-8 character is at most 4 bytes, hence at most 4 byte-level tokens. Text still
# ending in '\ufffd' after this many unread tokens is genuinely invalid bytes from the
# model: emit it rather than let the window (and the per-token cost) grow without bound.
MAX_PENDING_TOKENS = 8

REPLACEMENT_CHAR = "\ufffd"


class TokenizerLike(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool) -> str: ...


class IncrementalDetokenizer:
    def __init__(self, tokenizer: TokenizerLike, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = params.skip_special_tokens
        self._stops: list[str] = list(params.stop or [])
        self._include_stop = params.include_stop_str_in_output
        # Characters a stop string can have before the newest text: they are both the stop
        # search's look-behind and what get_next_delta holds back.
        self._holdback = max((len(s) for s in self._stops), default=1) - 1
        # The window: window[:read] is already shown, window[read:] not yet.
        self._window: list[int] = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._read = len(self._window)
        self._prefix_text = self._decode(self._window)
        # The output as pieces, joined only when read: appending stays O(piece).
        self._pieces: list[str] = []
        self._tail = ""  # the last `_holdback` characters of the output
        self._unstreamed = ""  # output not yet returned by get_next_delta (bounded by the holdback)
        self.finished = False
        self.stop_string: str | None = None  # the stop string that ended the output, if any

    @property
    def output_text(self) -> str:
        """All text so far (cut at a stop string if one matched)."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    def update(self, new_token_ids: list[int]) -> str | None:
        """Add generated tokens. Returns the stop string when one matched (the detokenizer is
        then finished and ignores later tokens), else None."""
        if self.finished:
            return None
        for token_id in new_token_ids:
            self._window.append(token_id)
            delta = self._decode_step(force=len(self._window) - self._read >= MAX_PENDING_TOKENS)
            if delta and self._append(delta):
                return self.stop_string
        return None

    def get_next_delta(self) -> str:
        """Text produced since the last call; while unfinished, the last (longest stop - 1)
        characters wait, in case they begin a stop string."""
        keep = 0 if self.finished else self._holdback
        cut = max(len(self._unstreamed) - keep, 0)
        delta, self._unstreamed = self._unstreamed[:cut], self._unstreamed[cut:]
        return delta

    def finish(self) -> str | None:
        """The request ended: decode tokens still waiting for the rest of a character (their
        text may hold '\ufffd' now) and release held-back text to get_next_delta. Returns a
        stop string if the flushed text completed one (the output is cut there), else None."""
        found = None
        if not self.finished and len(self._window) > self._read:
            delta = self._decode_step(force=True)
            if delta and self._append(delta):
                found = self.stop_string
        self.finished = True
        return found

    # -- internals --

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _decode_step(self, force: bool) -> str:
        """Decode the window; return the new text and advance, or "" to keep waiting."""
        text = self._decode(self._window)
        complete = len(text) > len(self._prefix_text) and not text.endswith(REPLACEMENT_CHAR)
        if not (complete or force):
            return ""
        delta = text[len(self._prefix_text) :]
        # The tokens just read become the next step's prefix; older ones leave the window.
        self._window = self._window[self._read :]
        self._read = len(self._window)
        self._prefix_text = self._decode(self._window)
        return delta

    def _append(self, delta: str) -> bool:
        """Add text to the output; on a stop string, cut the output and finish. True on a stop."""
        searched = self._tail + delta
        self._pieces.append(delta)
        self._unstreamed += delta
        match = self._find_stop(searched)
        if match is None:
            if self._holdback:
                self._tail = searched[-self._holdback :]
            return False
        index, stop = match
        end = index + len(stop) if self._include_stop else index
        self._truncate(len(searched) - end)
        self.stop_string = stop
        self.finished = True
        return True

    def _find_stop(self, text: str) -> tuple[int, str] | None:
        """The earliest stop string in text (the shortest one on a tie: it completed first)."""
        best: tuple[int, str] | None = None
        for stop in self._stops:
            index = text.find(stop)
            if index != -1 and (best is None or (index, len(stop)) < (best[0], len(best[1]))):
                best = (index, stop)
        return best

    def _truncate(self, num_chars: int) -> None:
        """Drop the last num_chars characters of the output. They are all unstreamed: a stop
        match ends in the newest text, so it starts within the held-back characters."""
        if num_chars <= 0:
            return
        self._unstreamed = self._unstreamed[:-num_chars]
        while num_chars > 0:
            last = self._pieces.pop()
            if len(last) > num_chars:
                self._pieces.append(last[:-num_chars])
                break
            num_chars -= len(last)
