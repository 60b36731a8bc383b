"""BERT, the encoder behind sentence-transformers' embedders (all-MiniLM-L6-v2 and kin).

Word + position + token-type embeddings and a LayerNorm, then post-LayerNorm residual blocks:
bidirectional self-attention within each sequence, and a GELU MLP. It serves pooling requests
only (docs/models.md, Embeddings): there is no LM head, and no K/V is kept, since a prompt is
computed whole in one step (the scheduler never splits an encoder's prompt). The step arrives
flat, [T] tokens of many sequences end to end, with the encoder metadata the runner builds once
(layers/encoder_attention.py); every projection is fornax's Linear, so the native dense kernels
serve the steps they are planned for (layers/kernel_plan.py), in float32 or bfloat16. A text
pair (a cross-encoder's query and document) comes with per-token types: 0 for the first text,
1 for the second (models/bert_classifier.py).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fornax.config import ConfigError, ModelConfig, PoolingConfig
from fornax.layers.encoder_attention import EncoderMetadata, encoder_attention
from fornax.layers.linear import Linear
from fornax.layers.ops import LayerOps
from fornax.models.base import LinearForms
from fornax.models.loader import ModelLoadError

# BertForSequenceClassification: the encoder with a classifier head (a cross-encoder).
ENCODER_ARCHITECTURES = frozenset({"BertModel", "BertForSequenceClassification"})


def bert_model_config(raw: dict[str, Any], name: str, pooling: PoolingConfig) -> ModelConfig:
    """A BERT config.json as fornax's ModelConfig; ConfigError/KeyError for what cannot work."""
    if raw.get("position_embedding_type", "absolute") != "absolute":
        raise ConfigError(f"unsupported position_embedding_type {raw['position_embedding_type']!r}")
    if raw.get("hidden_act", "gelu") != "gelu":
        raise ConfigError(f"unsupported BERT activation {raw['hidden_act']!r} (supported: gelu)")
    heads = int(raw["num_attention_heads"])
    archs = raw.get("architectures") or ["BertModel"]
    return ModelConfig(
        architecture=str(archs[0]),
        vocab_size=int(raw["vocab_size"]),
        hidden_size=int(raw["hidden_size"]),
        intermediate_size=int(raw["intermediate_size"]),
        num_hidden_layers=int(raw["num_hidden_layers"]),
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=int(raw["hidden_size"]) // heads,
        rms_norm_eps=float(raw.get("layer_norm_eps", 1e-12)),  # LayerNorm's epsilon here
        max_position_embeddings=int(raw.get("max_position_embeddings", 512)),
        hidden_act="gelu",
        name=name,
        encoder=True,
        type_vocab_size=int(raw.get("type_vocab_size", 2)),
        pooling=pooling,
    )


class LayerNorm(nn.Module):
    """LayerNorm with a weight and a bias, in the model's dtype (as transformers runs BERT)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(dim, dtype=dtype), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


class BertLayer(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        h = config.hidden_size
        self.num_heads, self.head_dim = config.num_attention_heads, config.head_dim
        self.qkv = Linear(h, 3 * h, True, dtype)  # query, key and value in one matmul
        self.attn_out = Linear(h, h, True, dtype)
        self.attn_norm = LayerNorm(h, config.rms_norm_eps, dtype)
        self.intermediate = Linear(h, config.intermediate_size, True, dtype)
        self.out = Linear(config.intermediate_size, h, True, dtype)
        self.out_norm = LayerNorm(h, config.rms_norm_eps, dtype)
        self.scale = self.head_dim**-0.5

    def forward(self, x: torch.Tensor, meta: EncoderMetadata) -> torch.Tensor:
        t, h, d = x.shape[0], self.num_heads, self.head_dim
        q, k, v = self.qkv(x).view(t, 3, h, d).unbind(1)  # each [T, H, D]
        a = encoder_attention(q, k, v, meta, self.scale).reshape(t, h * d)  # [T, hidden]
        x = self.attn_norm(self.attn_out(a) + x)  # post-LayerNorm: the norm follows the residual add
        return self.out_norm(self.out(F.gelu(self.intermediate(x))) + x)  # exact (erf) GELU, as BERT's


class BertModel(LinearForms):
    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.config, self.dtype = config, dtype
        h = config.hidden_size
        self.word_embeddings = _table(config.vocab_size, h, dtype)
        self.position_embeddings = _table(config.max_position_embeddings, h, dtype)
        self.token_type_embeddings = _table(config.type_vocab_size, h, dtype)
        self.embed_norm = LayerNorm(h, config.rms_norm_eps, dtype)
        self.layers = nn.ModuleList(BertLayer(config, dtype) for _ in range(config.num_hidden_layers))

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T], from 0 in each sequence
        meta: EncoderMetadata,
        token_type_ids: torch.Tensor | None = None,  # [T]; None: every token of type 0
    ) -> torch.Tensor:
        """The last layer's hidden states, [T, hidden] (what sentence-transformers pools)."""
        # One text per sequence (an embedding) is all type 0: one row added to every token,
        # no gather. The sum in transformers' order.
        types = (
            self.token_type_embeddings.weight[0]
            if token_type_ids is None
            else self.token_type_embeddings(token_type_ids)  # [T, hidden]
        )
        x = self.word_embeddings(input_ids) + types
        x = self.embed_norm(x + self.position_embeddings(positions))
        for layer in self.layers:
            x = layer(x, meta)
        return x

    def linear_sources(self) -> list[tuple[Linear, list[str]]]:
        """Each Linear with the HF weight names fused into it, in order (rows concatenated)."""
        out: list[tuple[Linear, list[str]]] = []
        for i, layer in enumerate(self.layers):
            p = f"encoder.layer.{i}."
            out.append((layer.qkv, [p + f"attention.self.{n}.weight" for n in ("query", "key", "value")]))
            out.append((layer.attn_out, [p + "attention.output.dense.weight"]))
            out.append((layer.intermediate, [p + "intermediate.dense.weight"]))
            out.append((layer.out, [p + "output.dense.weight"]))
        return out

    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy HF-named tensors in (a `bert.` prefix, as task heads save them, is dropped)."""
        tensors = {name.removeprefix("bert."): t for name, t in tensors.items()}
        missing = [n for n in self._required_names() if n not in tensors]
        if missing:
            raise ModelLoadError(f"the BERT weights are missing {len(missing)} tensors, e.g. {missing[0]}")
        self.word_embeddings.weight.copy_(tensors["embeddings.word_embeddings.weight"])
        self.position_embeddings.weight.copy_(tensors["embeddings.position_embeddings.weight"])
        self.token_type_embeddings.weight.copy_(tensors["embeddings.token_type_embeddings.weight"])
        _copy_norm(self.embed_norm, tensors, "embeddings.LayerNorm.")
        for linear, names in self.linear_sources():
            torch.cat([tensors[n] for n in names], dim=0, out=linear.weight)  # one pass, no temporary
            assert linear.bias is not None
            linear.bias.copy_(torch.cat([tensors[n.removesuffix("weight") + "bias"] for n in names]))
        for i, layer in enumerate(self.layers):
            p = f"encoder.layer.{i}."
            _copy_norm(layer.attn_norm, tensors, p + "attention.output.LayerNorm.")
            _copy_norm(layer.out_norm, tensors, p + "output.LayerNorm.")

    def _required_names(self) -> list[str]:
        names = [
            f"embeddings.{n}.weight"
            for n in ("word_embeddings", "position_embeddings", "token_type_embeddings")
        ]
        names += ["embeddings.LayerNorm.weight", "embeddings.LayerNorm.bias"]
        for i, _ in enumerate(self.layers):
            p = f"encoder.layer.{i}."
            names += [
                p + f"{norm}.LayerNorm.{n}"
                for norm in ("attention.output", "output")
                for n in ("weight", "bias")
            ]
        for _, sources in self.linear_sources():
            names += sources + [n.removesuffix("weight") + "bias" for n in sources]
        return names

    def use_ops(self, ops: LayerOps) -> None:
        """BERT's LayerNorm and GELU are torch's own: the native fused ops (RMSNorm, rotary,
        gated MLPs) have nothing to run here."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("an encoder model has no LM head: it serves pooling requests only")


def _table(rows: int, dim: int, dtype: torch.dtype) -> nn.Embedding:
    """An embedding table given its (empty) weight, so that it skips a random init that loading
    overwrites."""
    return nn.Embedding(rows, dim, _weight=torch.empty(rows, dim, dtype=dtype), _freeze=True)


def _copy_norm(norm: LayerNorm, tensors: dict[str, torch.Tensor], prefix: str) -> None:
    norm.weight.copy_(tensors[prefix + "weight"])
    norm.bias.copy_(tensors[prefix + "bias"])
