"""Workloads for `fornax bench serve`: lists of prompts with a target output length.

Everything here is pure and seeded: the same arguments and seed give the same prompts,
so two servers (or two builds of one) can be compared on identical traffic. Nothing here
talks to a server; the CLI may measure `tokens_per_word` over HTTP first and pass it in.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np

from fornax.bench import BenchUsageError

DATASETS = ("random", "prefix-repetition", "sharegpt", "builtin")

# Common, short English words. Nearly every BPE vocabulary of note holds each of them, with a
# leading space, as one token, so "N words" is close to "N tokens" before any calibration.
WORDS: tuple[str, ...] = tuple(
    """the of and to in is for on with as at by from that this it be are was or an not
    but all can has have had were will one two three four five six seven eight nine ten
    new more most some many much time year day way man world life hand part child eye
    place work week case point number group home water room mother area money story fact
    month lot right study book job word business issue side kind head house service friend
    father power hour game line end member law car city name team minute idea body
    information back parent face others level office door health person art war history
    party result change morning reason research girl guy moment air teacher force order
    good first last long great little own other old big high different small large next
    early young important few public bad same able red blue green black white light dark
    make go know take see come think look want give use find tell ask feel try leave call
    keep let begin seem help talk turn start show hear play run move like live believe
    bring happen write sit stand lose pay meet include continue set learn lead understand
    watch follow stop create speak read spend grow open walk win offer remember love
    consider appear buy wait serve die send expect build stay fall cut reach kill remain
    river stone tree field road sky rain snow wind fire sea island hill garden bridge
    table chair window paper letter music song picture voice bird horse dog cat fish
    bread milk apple sugar salt tea coffee food dinner lunch street market station village""".split()
)

CJK_RANGES = ((0x3040, 0x30FF), (0x3400, 0x4DBF), (0x4E00, 0x9FFF), (0xAC00, 0xD7AF), (0xF900, 0xFAFF))


@dataclass(frozen=True)
class BenchRequest:
    """One request of a workload. `prompt_len` is an estimate until the server's usage says otherwise."""

    prompt: str
    prompt_len: int
    output_len: int
    ignore_eos: bool


def random_text(rng: np.random.Generator, num_tokens: int, tokens_per_word: float) -> str:
    """About `num_tokens` tokens of words drawn from WORDS (no grammar; only the count matters)."""
    num_words = max(1, round(num_tokens / tokens_per_word))
    picks = rng.integers(0, len(WORDS), size=num_words)
    return " ".join(WORDS[i] for i in picks)


def approx_token_count(text: str, tokens_per_word: float = 1.3) -> int:
    """A tokenizer-free guess: one token per CJK character, `tokens_per_word` per other word.

    Used for ShareGPT answer lengths and the built-in prompts, where no exact count is needed:
    the server's usage gives the real counts afterwards.
    """
    cjk = sum(1 for ch in text if any(lo <= ord(ch) <= hi for lo, hi in CJK_RANGES))
    other = "".join(" " if any(lo <= ord(ch) <= hi for lo, hi in CJK_RANGES) else ch for ch in text)
    words = len(other.split())
    return max(1, cjk + round(max(words * tokens_per_word, len(other.strip()) / 4)))


def _lengths(rng: np.random.Generator, mean: int, range_ratio: float, n: int) -> np.ndarray:
    """`n` integer lengths uniform in [mean*(1-r), mean*(1+r)], never below 1."""
    lo = max(1, int(mean * (1.0 - range_ratio)))
    hi = max(lo, int(mean * (1.0 + range_ratio)))
    return rng.integers(lo, hi + 1, size=n)


def random_workload(
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    seed: int = 0,
    tokens_per_word: float = 1.0,
) -> list[BenchRequest]:
    """Independent random prompts; each one starts differently so no prefix is shared."""
    if not 0.0 <= range_ratio < 1.0:
        raise BenchUsageError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    if input_len < 1 or output_len < 1:
        raise BenchUsageError("--random-input-len and --random-output-len must be at least 1")
    rng = np.random.default_rng(seed)
    in_lens = _lengths(rng, input_len, range_ratio, num_prompts)
    out_lens = _lengths(rng, output_len, range_ratio, num_prompts)
    return [
        BenchRequest(random_text(rng, int(i), tokens_per_word), int(i), int(o), ignore_eos=True)
        for i, o in zip(in_lens, out_lens)
    ]


def prefix_repetition_workload(
    num_prompts: int,
    prefix_len: int,
    num_prefixes: int,
    suffix_len: int,
    output_len: int,
    seed: int = 0,
    tokens_per_word: float = 1.0,
) -> list[BenchRequest]:
    """`num_prefixes` shared prefixes, each followed by distinct suffixes, in shuffled order.

    With prefix caching on, every prompt after the first with a given prefix should only
    prefill its suffix: compare TTFT with caching on and off to see the gain.
    """
    if num_prefixes < 1 or prefix_len < 1 or suffix_len < 0 or output_len < 1:
        raise BenchUsageError(
            "--num-prefixes, --prefix-len and --random-output-len must be >= 1, --suffix-len >= 0"
        )
    rng = np.random.default_rng(seed)
    prefixes = [random_text(rng, prefix_len, tokens_per_word) for _ in range(num_prefixes)]
    out: list[BenchRequest] = []
    for i in range(num_prompts):
        suffix = random_text(rng, suffix_len, tokens_per_word) if suffix_len else ""
        prompt = f"{prefixes[i % num_prefixes]} {suffix}".rstrip()
        out.append(BenchRequest(prompt, prefix_len + suffix_len, output_len, ignore_eos=True))
    order = rng.permutation(len(out))
    return [out[i] for i in order]


def _first_exchange(conversation: dict) -> tuple[str, str] | None:
    """The first human turn and the gpt turn that answers it, or None."""
    turns = conversation.get("conversations") or conversation.get("conversation") or []
    for a, b in itertools.pairwise(turns):
        if not (isinstance(a, dict) and isinstance(b, dict)):
            return None
        if a.get("from") in ("human", "user") and b.get("from") in ("gpt", "assistant"):
            prompt, answer = a.get("value"), b.get("value")
            if isinstance(prompt, str) and isinstance(answer, str):
                return prompt, answer
            return None
    return None


def sharegpt_workload(
    path: str | Path,
    num_prompts: int,
    seed: int = 0,
    output_len: int | None = None,
    max_prompt_len: int = 4096,
) -> list[BenchRequest]:
    """Prompts from a ShareGPT-format JSON file: the first human turn, answered at the gpt turn's length.

    Exchanges with a prompt or answer under 4 tokens, or a prompt over `max_prompt_len`, are
    skipped; the rest are shuffled and cycled if fewer than `num_prompts` remain.
    """
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise BenchUsageError(f"cannot read ShareGPT file {path}: {exc}") from None
    if not isinstance(data, list):
        raise BenchUsageError(f"ShareGPT file {path}: expected a JSON list of conversations")
    pool: list[BenchRequest] = []
    for conv in data:
        pair = _first_exchange(conv) if isinstance(conv, dict) else None
        if pair is None:
            continue
        p_len, a_len = approx_token_count(pair[0]), approx_token_count(pair[1])
        if p_len < 4 or a_len < 4 or p_len > max_prompt_len:
            continue
        pool.append(BenchRequest(pair[0], p_len, output_len or a_len, ignore_eos=False))
    if not pool:
        raise BenchUsageError(f"ShareGPT file {path}: no usable human/gpt exchange found")
    return _sample(pool, num_prompts, seed)


def builtin_prompts() -> list[dict]:
    """The packaged prompt set: dicts with `prompt`, `output_len` and `kind`."""
    text = resources.files("fornax.bench").joinpath("data/prompts.jsonl").read_text(encoding="utf-8")
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def builtin_workload(num_prompts: int, seed: int = 0, output_len: int | None = None) -> list[BenchRequest]:
    """The packaged real prompts (questions, code, summaries, CJK, ...), shuffled and cycled."""
    pool = [
        BenchRequest(
            p["prompt"], approx_token_count(p["prompt"]), output_len or int(p["output_len"]), ignore_eos=False
        )
        for p in builtin_prompts()
    ]
    return _sample(pool, num_prompts, seed)


def _sample(pool: list[BenchRequest], n: int, seed: int) -> list[BenchRequest]:
    rng = np.random.default_rng(seed)
    out: list[BenchRequest] = []
    while len(out) < n:
        out.extend(pool[i] for i in rng.permutation(len(pool)))
    return out[:n]


def arrival_offsets(n: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> np.ndarray:
    """Send times in seconds after the start, for `n` requests at `request_rate` req/s on average.

    Gaps are gamma distributed with shape `burstiness` and mean 1/rate: shape 1 is a Poisson
    process, below 1 is burstier (clumps and lulls), above 1 is more regular. An infinite rate
    sends everything at once.
    """
    if request_rate <= 0:
        raise BenchUsageError(f"--request-rate must be positive, got {request_rate}")
    if burstiness <= 0:
        raise BenchUsageError(f"--burstiness must be positive, got {burstiness}")
    if np.isinf(request_rate) or n == 0:
        return np.zeros(n)
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=n)
    gaps[0] = 0.0  # the first request goes at once; the run's clock starts with it
    return np.cumsum(gaps)
