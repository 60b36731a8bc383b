"""Perplexity of a model on a fixed, real English text, through the engine itself.

The corpus is the GNU GPL version 3 as Debian ships it (/usr/share/common-licenses/GPL-3, in
the `base-files` package present on every Debian system): real English prose that nobody
wrote for this test, available offline, and pinned by its sha256 so every run scores the
same tokens. It is cut into windows of `window` tokens; each window is one prompt whose
`prompt_logprobs` give log p(token | the window's earlier tokens), and perplexity is
exp(-mean) over every token but each window's first.

Quantized forms only serve steps of at most `small_step_max_rows` tokens, so a quality
measurement of them sets that threshold above the window: every token then goes through
the quantized kernels.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CORPUS_PATH = Path("/usr/share/common-licenses/GPL-3")
CORPUS_SHA256 = "3972dc9744f6499f0f9b2dbf76696f2ae7ad8af9b23dde66d6af86c9dfb36986"


class CorpusError(RuntimeError):
    pass


def load_corpus(path: Path = CORPUS_PATH) -> str:
    """The pinned corpus text; a clear error when it is missing or not the expected file."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise CorpusError(
            f"perplexity corpus {path} is not readable ({exc}); it comes with Debian's base-files"
        ) from exc
    digest = hashlib.sha256(data).hexdigest()
    if digest != CORPUS_SHA256:
        raise CorpusError(f"perplexity corpus {path} has sha256 {digest}, expected {CORPUS_SHA256}")
    return data.decode("utf-8")


@dataclass
class PerplexityResult:
    perplexity: float
    num_scored_tokens: int
    num_windows: int


def perplexity(llm: Any, text: str, window: int = 512, max_windows: int | None = None) -> PerplexityResult:
    """Perplexity of `llm` (a fornax.LLM) on `text`, in non-overlapping windows of `window` tokens."""
    from fornax.engine.request import SamplingParams

    ids = llm.get_tokenizer().encode(text)
    windows = [ids[i : i + window] for i in range(0, len(ids) - 1, window)]
    windows = [w for w in windows if len(w) > 1][:max_windows]
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    outputs = llm.generate(windows, params)
    total, count = 0.0, 0
    for out in outputs:
        scored = [lp for lp in out.prompt_logprobs[1:] if lp is not None]
        total += sum(lp.logprob for lp in scored)
        count += len(scored)
    return PerplexityResult(math.exp(-total / count), count, len(windows))
