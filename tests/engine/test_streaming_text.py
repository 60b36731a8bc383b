"""Text out of the engine: stop strings across token boundaries, stop tokens, length and
min_tokens, and UTF-8 safe streaming of emoji and CJK.

Each check compares against a greedy run of the same prompt alone on the same engine, which
is deterministic, so bf16 is safe here.
"""

from __future__ import annotations

import pytest

from fornax import LLM, SamplingParams

pytestmark = pytest.mark.slow

REPLACEMENT = "\ufffd"


@pytest.fixture(scope="module")
def llm(default_gguf):
    # Every check here compares a run with an earlier greedy run of the same prompt. In bf16 a
    # prefix-cache hit changes the attention path of the prefill and with it the last bits of
    # the logits, so caching is off: both runs then compute exactly the same way.
    return LLM(
        str(default_gguf),
        dtype="bfloat16",
        kv_cache_memory="128MiB",
        enable_prefix_caching=False,
        progress=False,
    )


def _chat(llm: LLM, text: str) -> list[int]:
    return llm.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
    )


def _greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kwargs)


def _spanning_stop(tok, ids: list[int]) -> tuple[str, int]:
    """A stop string made of the end of one token and the start of the next (both printable),
    and the token index where it completes."""
    text = tok.decode(ids)
    for i in range(len(ids) - 1):
        left, right = tok.decode(ids[i : i + 1]), tok.decode(ids[i + 1 : i + 2])
        if len(left.strip()) < 2 or len(right.strip()) < 2 or REPLACEMENT in left + right:
            continue
        stop = left[-2:] + right[:2]
        end_of_left = len(tok.decode(ids[: i + 1]))
        if text.find(stop) == end_of_left - 2:  # its first occurrence is this boundary
            return stop, i + 1
    raise AssertionError(f"no stop string spanning two tokens in {text!r}")


def test_stop_string_across_tokens(llm):
    tok = llm.get_tokenizer()
    prompt = _chat(llm, "Describe a walk in the forest in three sentences.")
    full = llm.generate([prompt], _greedy(40, ignore_eos=True))[0].outputs[0]
    stop, last_index = _spanning_stop(tok, full.token_ids)
    cut = full.text.find(stop)

    out = llm.generate([prompt], _greedy(40, ignore_eos=True, stop=["never-appears", stop]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full.text[:cut]
    assert out.token_ids == full.token_ids[: last_index + 1]  # it stopped on the completing token

    kept = llm.generate([prompt], _greedy(40, ignore_eos=True, stop=stop, include_stop_str_in_output=True))[0]
    assert kept.outputs[0].text == full.text[: cut + len(stop)] and kept.outputs[0].text.endswith(stop)
    assert kept.outputs[0].stop_reason == stop


def test_stop_token_ids_max_tokens_and_min_tokens(llm):
    tok = llm.get_tokenizer()
    prompt = _chat(llm, "What is 2+2? Answer with one number.")
    natural = llm.generate([prompt], _greedy(40))[0].outputs[0]
    # The model answers briefly and ends with EOS of its own accord.
    assert natural.finish_reason == "stop" and natural.token_ids[-1] in tok.eos_token_ids
    assert natural.stop_reason is None and len(natural.token_ids) < 20

    stop_id = natural.token_ids[2]
    first = natural.token_ids.index(stop_id)
    by_id = llm.generate([prompt], _greedy(40, stop_token_ids=[stop_id]))[0].outputs[0]
    assert by_id.finish_reason == "stop" and by_id.stop_reason == stop_id
    assert by_id.token_ids == natural.token_ids[: first + 1]
    assert by_id.text == tok.decode(natural.token_ids[:first])  # the stop token's text is left out

    short = llm.generate([prompt], _greedy(3))[0].outputs[0]
    assert short.finish_reason == "length" and short.token_ids == natural.token_ids[:3]

    n_min = len(natural.token_ids) + 6
    min_params = _greedy(n_min + 30, min_tokens=n_min, stop_token_ids=[stop_id])
    longer = llm.generate([prompt], min_params)[0].outputs[0]
    assert len(longer.token_ids) >= n_min
    early = longer.token_ids[:n_min]
    assert not set(early) & (set(tok.eos_token_ids) | {stop_id})  # neither EOS nor the stop id before min


STREAM_PROMPTS = {
    "zh-chat": ("chat", "Translate to Chinese: Good morning, my friend. How are you today?"),
    "ja-chat": ("chat", "Write the word 'hello' in Japanese, Chinese and Korean."),
    "emoji-raw": ("raw", "🍎🍌🍇🍉🍓🍒🍑🍍"),
    "zh-raw": ("raw", "中文：我们今天去公园散步，然后"),
}


@pytest.mark.parametrize(
    "name, stop",
    [(name, None) for name in STREAM_PROMPTS] + [("zh-chat", ["@@@"]), ("emoji-raw", ["@@@"])],
    ids=lambda v: "holdback" if v == ["@@@"] else (v or "plain"),
)
def test_stream_deltas_are_whole_characters(llm, name, stop):
    """A stop string makes the detokenizer hold text back: the deltas must stay whole then too."""
    tok = llm.get_tokenizer()
    kind, text = STREAM_PROMPTS[name]
    prompt = _chat(llm, text) if kind == "chat" else tok.encode(text)
    probe = llm.generate([prompt], _greedy(32, ignore_eos=True))[0].outputs[0].token_ids
    # Stop on a character boundary: the longest prefix whose text is valid UTF-8 throughout
    # (a cut in the middle of a character rightly ends in U+FFFD).
    length = max(n for n in range(1, len(probe) + 1) if REPLACEMENT not in tok.decode(probe[:n]))
    split = [t for t in probe[:length] if REPLACEMENT in tok.decode([t])]
    assert length >= 10 and split, "the prompt must make the model emit multi-token characters"

    deltas, final = [], None
    for out in llm.stream(prompt, _greedy(length, ignore_eos=True, stop=stop)):
        assert REPLACEMENT not in out.new_text, f"delta {out.new_text!r} splits a character"
        deltas.append(out.new_text)
        final = out
    assert final is not None and final.finished and final.finish_reason == "length"
    assert "".join(deltas) == tok.decode(probe[:length])
    assert sum(1 for d in deltas if d) > 1  # it really streamed
    llm.engine.check_integrity()
