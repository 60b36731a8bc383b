"""How a model turns its hidden states into one vector (embeddings; docs/models.md, Embeddings).

A model may say how it pools: a sentence-transformers directory does in modules.json and
1_Pooling/config.json (mean, CLS or last token; a Normalize module; the longest input it was
trained on), and a config.json may declare Matryoshka dimensions. This is the frozen record of
that, part of ModelConfig; a pooling request takes it as its default, and the engine flag
`--pooling` overrides its type.

A cross-encoder (a sequence-classification model: BertForSequenceClassification) pools too, but
through its head: the [CLS] row goes through the model's pooler and classifier, and its "vector"
is the head's `num_labels` scores after `score_activation` (models/bert_classifier.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from fornax.config.common import ConfigError

# mean: the average of every prompt position's final hidden state; cls: the first position's
# (BERT's [CLS]); last: the last prompt position's (decoder embedders: it has seen the whole text).
POOLING_TYPES = ("mean", "cls", "last")
# What a cross-encoder's logits pass through (sentence-transformers' CrossEncoder.activation_fn).
SCORE_ACTIVATIONS = ("sigmoid", "identity")


@dataclass(frozen=True)
class PoolingConfig:
    """A model's own pooling: what a pooling request gets unless it asks otherwise."""

    type: str | None = None  # None: the engine's --pooling, else mean for encoders, last for decoders
    normalize: bool = True  # L2-normalize the vector (sentence-transformers: a Normalize module)
    # The longest input the embedder was trained on (sentence_bert_config.json's max_seq_length);
    # an encoder serves no longer prompt. None: the model's context.
    max_seq_length: int | None = None
    # Matryoshka representation learning: a prefix of the vector is itself an embedding, so a
    # request may ask for `dimensions` (truncated, then renormalized). False: such requests are
    # refused. matryoshka_dimensions: the sizes it was trained for (empty: any size).
    matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] = ()
    # A cross-encoder's classifier: how many scores it gives per text pair (0: no head, an
    # embedder), and the activation on its logits.
    num_labels: int = 0
    score_activation: str = "identity"

    @property
    def cross_encoder(self) -> bool:
        """Whether the model scores text pairs through a classifier head instead of embedding."""
        return self.num_labels > 0

    def __post_init__(self) -> None:
        if self.type is not None and self.type not in POOLING_TYPES:
            raise ConfigError(f"pooling type must be one of {', '.join(POOLING_TYPES)}, got {self.type!r}")
        if self.max_seq_length is not None and self.max_seq_length < 1:
            raise ConfigError(f"max_seq_length must be positive, got {self.max_seq_length}")
        if any(not isinstance(d, int) or d < 1 for d in self.matryoshka_dimensions):
            raise ConfigError(
                f"matryoshka dimensions must be positive integers, got {self.matryoshka_dimensions}"
            )
        if self.num_labels < 0:
            raise ConfigError(f"num_labels must be >= 0, got {self.num_labels}")
        if self.score_activation not in SCORE_ACTIVATIONS:
            raise ConfigError(
                f"score activation must be one of {', '.join(SCORE_ACTIVATIONS)}, got {self.score_activation!r}"
            )
