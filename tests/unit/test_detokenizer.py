"""Incremental detokenizer tests against the default model's real tokenizer (byte-level BPE,
where one emoji or CJK character spans several tokens)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from fornax.engine.detokenizer import IncrementalDetokenizer
from fornax.engine.request import SamplingParams
from tests.hf_reference import one_gguf_parse

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase as HFTokenizer


@pytest.fixture(scope="module")
def tokenizer(default_gguf: Path) -> HFTokenizer:
    # The HF tokenizer built from the GGUF is the reference; the detokenizer only needs its
    # decode(ids, skip_special_tokens=...), which fornax.tokenizer.Tokenizer provides too.
    from transformers import AutoTokenizer

    with one_gguf_parse():
        return AutoTokenizer.from_pretrained(str(default_gguf.parent), gguf_file=default_gguf.name)


def encode(tokenizer: HFTokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def decode(tokenizer: HFTokenizer, ids: list[int], skip: bool = True) -> str:
    return tokenizer.decode(ids, skip_special_tokens=skip)


PROMPT = "<|im_start|>user\nSay something.<|im_end|>\n<|im_start|>assistant\n"

TEXTS = [
    "Hello, world! This is a plain English sentence.",
    "def square(x: int) -> int:\n    return x ** 2  # tabs\tand    spaces\n",
    "什么是 LLM 推理？",
    "👩🏽‍💻🚀",
    "Mixed: naïve café, 日本語テキスト, 👨‍👩‍👧‍👦 family, done 🎉!",
]


def stream(detok: IncrementalDetokenizer, ids: list[int]) -> tuple[list[str], str | None]:
    """Feed tokens one at a time, collecting every delta (the final one after finish())."""
    deltas = []
    stop = None
    for token in ids:
        stop = detok.update([token])
        deltas.append(detok.get_next_delta())
        if stop is not None:
            break
    detok.finish()
    deltas.append(detok.get_next_delta())
    return deltas, stop


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_deltas_equal_full_decode(tokenizer: HFTokenizer, text: str) -> None:
    prompt = encode(tokenizer, PROMPT)
    ids = encode(tokenizer, text)
    detok = IncrementalDetokenizer(tokenizer, prompt, SamplingParams())
    deltas, stop = stream(detok, ids)
    assert stop is None
    assert "".join(deltas) == decode(tokenizer, ids) == detok.output_text
    assert all("\ufffd" not in d for d in deltas)


@pytest.mark.parametrize("text", TEXTS[2:])
def test_multi_byte_characters_are_never_split(tokenizer: HFTokenizer, text: str) -> None:
    # With stop strings (so some text is held back) and several tokens per update.
    ids = encode(tokenizer, text)
    detok = IncrementalDetokenizer(tokenizer, [1], SamplingParams(stop=["never appears here"]))
    deltas = []
    for start in range(0, len(ids), 3):
        assert detok.update(ids[start : start + 3]) is None
        deltas.append(detok.get_next_delta())
        assert "\ufffd" not in detok.output_text
    detok.finish()
    deltas.append(detok.get_next_delta())
    assert "".join(deltas) == decode(tokenizer, ids)
    assert all("\ufffd" not in d for d in deltas)


def find_spanning_stop(tokenizer: HFTokenizer, text: str, stop: str) -> list[int]:
    """Token ids of text, checking that `stop` really is split across two tokens."""
    ids = encode(tokenizer, text)
    pieces = [decode(tokenizer, [i]) for i in ids]
    assert all(stop not in p for p in pieces), pieces
    return ids


def test_stop_string_across_tokens_is_found_and_not_emitted(tokenizer: HFTokenizer) -> None:
    text = "The answer is 42. STOP here and more text after it."
    ids = find_spanning_stop(tokenizer, text, "answer is 4")
    detok = IncrementalDetokenizer(tokenizer, [1], SamplingParams(stop=["xyz", "answer is 4"]))
    deltas, stop = stream(detok, ids)
    assert stop == "answer is 4" and detok.stop_string == stop and detok.finished
    assert detok.output_text == "The "
    assert "".join(deltas) == "The "
    assert detok.update(encode(tokenizer, " more")) is None and detok.output_text == "The "


def test_stop_string_kept_with_include_stop_str_in_output(tokenizer: HFTokenizer) -> None:
    ids = find_spanning_stop(tokenizer, "The answer is 42. More text.", "answer is 4")
    params = SamplingParams(stop=["answer is 4"], include_stop_str_in_output=True)
    detok = IncrementalDetokenizer(tokenizer, [1], params)
    deltas, stop = stream(detok, ids)
    assert stop == "answer is 4"
    assert detok.output_text == "The answer is 4" == "".join(deltas)


def test_earliest_stop_string_wins(tokenizer: HFTokenizer) -> None:
    ids = encode(tokenizer, "one two three four")
    detok = IncrementalDetokenizer(tokenizer, [1], SamplingParams(stop=["four", "two three"]))
    detok.update(ids)  # all at once: both stop strings are in the same update
    assert detok.stop_string == "two three" and detok.output_text == "one "


def test_partial_stop_string_is_held_back_then_released(tokenizer: HFTokenizer) -> None:
    text = "Done. The end"
    ids = encode(tokenizer, text)
    detok = IncrementalDetokenizer(tokenizer, [1], SamplingParams(stop=["The end of it"]))
    streamed = ""
    for token in ids:
        assert detok.update([token]) is None
        streamed += detok.get_next_delta()
    # "The end" could still grow into the stop string, and so could anything within the
    # last len(stop) - 1 characters: nothing of it has been streamed yet.
    assert detok.output_text == text
    assert len(streamed) <= max(0, len(text) - (len("The end of it") - 1))
    assert "The end" not in streamed
    assert detok.finish() is None
    assert streamed + detok.get_next_delta() == text
    assert detok.get_next_delta() == ""


def test_skip_special_tokens(tokenizer: HFTokenizer) -> None:
    ids = encode(tokenizer, "Hi there.<|im_end|>")
    assert len(ids) > 1 and "<|im_end|>" not in decode(tokenizer, ids[-1:], skip=True)
    skipped = IncrementalDetokenizer(tokenizer, [1], SamplingParams())
    kept = IncrementalDetokenizer(tokenizer, [1], SamplingParams(skip_special_tokens=False))
    assert "".join(stream(skipped, ids)[0]) == "Hi there."
    assert "".join(stream(kept, ids)[0]) == "Hi there.<|im_end|>"


def test_truncated_character_is_flushed_on_finish(tokenizer: HFTokenizer) -> None:
    # The request ends (say at max_tokens) in the middle of an emoji: the bytes so far are
    # held back while it runs and show as '\ufffd' once it is over, as the full decode does.
    ids = encode(tokenizer, "ok 🚀")[:-1]
    detok = IncrementalDetokenizer(tokenizer, [1], SamplingParams())
    deltas, _ = stream(detok, ids)
    assert all("\ufffd" not in d for d in deltas[:-1])
    assert "".join(deltas) == decode(tokenizer, ids) and deltas[-1].endswith("\ufffd")


class CountingTokenizer:
    """Wraps a tokenizer to record how many ids each decode call gets."""

    def __init__(self, inner: HFTokenizer) -> None:
        self.inner = inner
        self.sizes: list[int] = []

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        self.sizes.append(len(ids))
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


def test_cost_per_token_is_bounded(tokenizer: HFTokenizer) -> None:
    counting = CountingTokenizer(tokenizer)
    ids = encode(tokenizer, "Some words 👩🏽‍💻 and more words. " * 40)
    detok = IncrementalDetokenizer(counting, encode(tokenizer, PROMPT), SamplingParams(stop=["zzz"]))
    for token in ids:
        detok.update([token])
    assert len(ids) > 300 and max(counting.sizes) <= 12
    assert len(counting.sizes) <= 2 * len(ids) + 1
    detok.finish()
    assert detok.output_text == decode(tokenizer, ids)
