"""BertForSequenceClassification: BERT with a classifier head, served as a cross-encoder.

A cross-encoder reads a (query, document) pair as one sequence, [CLS] query [SEP] document
[SEP] with token types 0 then 1, and scores it from the [CLS] row: transformers' BertPooler
(a dense layer and tanh) and then the classifier's linear layer, `num_labels` logits. The score
is those logits through `PoolingConfig.score_activation`: by default what sentence-transformers'
CrossEncoder.predict returns (a sigmoid for one label, the raw logits for more), or the
activation the directory's config.json names (models/pooling_config.py).

The encoder is BertModel's (models/bert.py), unchanged; the runner's pooler calls `classify`
once per step on the [CLS] rows of the requests that end in it (engine/runner/pooler.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fornax.config import ModelConfig
from fornax.models.bert import BertModel
from fornax.models.loader import ModelLoadError

_HEAD = ("pooler.dense.weight", "pooler.dense.bias", "classifier.weight", "classifier.bias")


class BertForSequenceClassification(BertModel):
    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__(config, dtype)
        h, labels = config.hidden_size, config.pooling.num_labels
        if labels < 1:
            raise ModelLoadError("a sequence-classification model needs at least one label")
        # Plain tensors, not fornax's Linear forms: the head runs on one row per request, so a
        # quantized or native form would buy no time and could only move the scores.
        self.pooler_weight = _param(h, h, dtype)
        self.pooler_bias = _param(h, None, dtype)
        self.classifier_weight = _param(labels, h, dtype)
        self.classifier_bias = _param(labels, None, dtype)
        self.sigmoid = config.pooling.score_activation == "sigmoid"

    def classify(self, cls_rows: torch.Tensor) -> torch.Tensor:
        """[N, hidden] final hidden states of [CLS] -> [N, num_labels] float32 scores."""
        pooled = torch.tanh(F.linear(cls_rows.to(self.dtype), self.pooler_weight, self.pooler_bias))
        logits = F.linear(pooled, self.classifier_weight, self.classifier_bias).float()  # [N, labels]
        return torch.sigmoid(logits) if self.sigmoid else logits

    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """The encoder's tensors (under `bert.`), then the head's: `bert.pooler.dense.*` and
        `classifier.*`."""
        super().load_weights(tensors)
        head = {name.removeprefix("bert."): t for name, t in tensors.items()}
        missing = [n for n in _HEAD if n not in head]
        if missing:
            raise ModelLoadError(f"the sequence-classification weights are missing {missing[0]}")
        for target, name in zip(
            (self.pooler_weight, self.pooler_bias, self.classifier_weight, self.classifier_bias), _HEAD
        ):
            if tuple(head[name].shape) != tuple(target.shape):
                raise ModelLoadError(
                    f"{name} has shape {tuple(head[name].shape)}, expected {tuple(target.shape)} "
                    "(config.json's hidden_size and id2label)"
                )
            target.copy_(head[name])


def _param(rows: int, cols: int | None, dtype: torch.dtype) -> nn.Parameter:
    shape = (rows,) if cols is None else (rows, cols)
    return nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
