"""Scoring text pairs (LLM.score, /v1/score, /v1/rerank): which pairs, and how each is scored.

Both kinds of model score through pooling requests (engine/pooling.py):

- an embedding model by the cosine similarity of the two texts' embeddings;
- a cross-encoder (PoolingConfig.cross_encoder; models/bert_classifier.py) by reading the pair
  as one sequence, [CLS] first [SEP] second [SEP] with token types 0 then 1
  (Tokenizer.encode_pairs), and taking its classifier's score: for one label the logit through
  a sigmoid, as sentence-transformers' CrossEncoder.predict returns it by default, or the
  activation the model's config.json names.

What the offline API and the server share is here: the pairing rule and the two scores. No
torch: the vectors are short lists, compared once per request.
"""

from __future__ import annotations

import math
from typing import TypeVar

from fornax.config import ModelConfig

T = TypeVar("T")


class ScoringError(ValueError):
    """Pairs that cannot be scored; `param` names the field at fault (text_1, text_2, model)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def pair_up(first: list[str], second: list[str]) -> list[tuple[str, str]]:
    """vLLM's rule: one first text against each second text, or as many of each, pairwise."""
    if not first or not second:
        raise ScoringError("text_1" if not first else "text_2", "'text_1' and 'text_2' must not be empty")
    if len(first) != 1 and len(first) != len(second):
        raise ScoringError(
            "text_1",
            f"'text_1' holds {len(first)} texts and 'text_2' {len(second)}: give one "
            "text_1, or as many as text_2 (scored pairwise)",
        )
    return paired(first, second)


def paired(firsts: list[T], seconds: list[T]) -> list[tuple[T, T]]:
    """The pairing rule applied to whatever stands for each text (the text, its vector, its
    output), in pair_up's order: the one first with each second, or pairwise."""
    return [(firsts[0] if len(firsts) == 1 else firsts[i], b) for i, b in enumerate(seconds)]


def check_cross_encoder(model: ModelConfig) -> None:
    """A pair's score is one number: a cross-encoder with several labels gives several."""
    labels = model.pooling.num_labels
    if labels != 1:
        raise ScoringError(
            "model",
            f"{model.name} is a classifier of {labels} labels: scoring and reranking "
            "need one score per pair (a single-label cross-encoder)",
        )


def cosine(a: list[float], b: list[float]) -> float:
    norm = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    return sum(x * y for x, y in zip(a, b, strict=True)) / norm if norm else 0.0
