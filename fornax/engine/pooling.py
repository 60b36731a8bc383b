"""PoolingParams: what a pooling (embedding) request asks for in place of sampling.

A pooling request is prefill-only: the scheduler schedules its prompt like any other prefill
(the same queue, token budget and admission limits), and it finishes in the step that computes
its prompt's last token, with one vector pooled from the final hidden states instead of a
sampled token (engine/runner/pooler.py). No torch here: Request holds these, and the scheduler
reads them (docs/architecture.md, rule 1).

On a cross-encoder (PoolingConfig.cross_encoder) the "vector" is the classifier head's scores
for the prompt, a text pair whose `token_type_ids` mark the second text (models/bert_classifier.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from fornax.config import POOLING_TYPES, ModelConfig, PoolingConfig
from fornax.engine.request import Request, SamplingParams, SamplingParamsError

# What a pooling request carries where the engine reads sampling parameters (the detokenizer,
# the speculative controller): one token at most, never sampled, no drafts.
POOLING_SAMPLING = SamplingParams(max_tokens=1, temperature=0.0, num_speculative_tokens=0)


class PoolingParamsError(SamplingParamsError):
    """An invalid pooling parameter, or one the model cannot serve; `param` names the field."""


@dataclass(frozen=True)
class PoolingParams:
    """How to pool one request's hidden states into a vector. None: the engine's default
    (`--pooling`, else the model's own pooling config: config/pooling.py)."""

    pooling_type: str | None = None  # "mean" | "cls" | "last"
    normalize: bool | None = None  # L2-normalize the vector
    # Matryoshka: keep the first `dimensions` values, then renormalize (when normalize); only
    # for models trained for it (PoolingConfig.matryoshka), else refused.
    dimensions: int | None = None
    # BERT's segment of each prompt token (0: the first text, 1: the second of a pair, as the
    # tokenizer's pair encoding gives them: Tokenizer.encode_pairs); None: every token 0.
    token_type_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.pooling_type is not None and self.pooling_type not in POOLING_TYPES:
            types = ", ".join(POOLING_TYPES)
            raise PoolingParamsError(
                "pooling_type", f"pooling_type must be one of {types}, got {self.pooling_type!r}"
            )
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise PoolingParamsError("normalize", f"normalize must be a boolean, got {self.normalize!r}")
        d = self.dimensions
        if d is not None and (not isinstance(d, int) or isinstance(d, bool) or d < 1):
            raise PoolingParamsError("dimensions", f"dimensions must be a positive integer, got {d!r}")
        types = self.token_type_ids
        if types is not None:
            if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in types):
                raise PoolingParamsError("token_type_ids", "token_type_ids must be non-negative integers")
            object.__setattr__(self, "token_type_ids", tuple(types))  # frozen: held as a tuple

    def resolved(
        self, model: PoolingConfig, engine_type: str | None, hidden_size: int, encoder: bool
    ) -> PoolingParams:
        """These parameters with every default filled in for one model; PoolingParamsError for
        what the model cannot serve (`dimensions` of a model not trained for them)."""
        if model.cross_encoder:
            return self._for_cross_encoder()
        default_type = engine_type or model.type or ("mean" if encoder else "last")
        out = replace(
            self,
            pooling_type=self.pooling_type or default_type,
            normalize=model.normalize if self.normalize is None else self.normalize,
        )
        d = self.dimensions
        if d is None or d == hidden_size:  # the whole vector: nothing to truncate
            return replace(out, dimensions=None)
        if not model.matryoshka:
            raise PoolingParamsError(
                "dimensions",
                "this model does not support matryoshka representation: its embeddings cannot be "
                f"shortened (asked for dimensions={d} of {hidden_size})",
            )
        allowed = model.matryoshka_dimensions
        if d > hidden_size or (allowed and d not in allowed):
            sizes = ", ".join(map(str, allowed)) if allowed else f"1 to {hidden_size}"
            raise PoolingParamsError(
                "dimensions", f"dimensions must be one of this model's sizes ({sizes}), got {d}"
            )
        return out

    def _for_cross_encoder(self) -> PoolingParams:
        """A cross-encoder's head reads the [CLS] row and gives scores: nothing else to choose
        (the engine's --pooling does not apply), and no vector to cut or normalize."""
        if self.pooling_type not in (None, "cls"):
            raise PoolingParamsError(
                "pooling_type",
                "a cross-encoder scores a text pair from its [CLS] row through its classifier head: "
                f"pooling_type must be cls or left unset, got {self.pooling_type!r}",
            )
        if self.dimensions is not None:
            raise PoolingParamsError(
                "dimensions", "a cross-encoder gives scores, not an embedding: dimensions does not apply"
            )
        if self.normalize:
            raise PoolingParamsError("normalize", "a cross-encoder's scores are not normalized")
        return replace(self, pooling_type="cls", normalize=False)


def pooling_request(
    request_id: str,
    prompt_token_ids: list[int],
    params: PoolingParams,
    model: ModelConfig,
    engine_type: str | None,
    max_model_len: int,
    priority: int = 0,
    cache_salt: str | None = None,
) -> Request:
    """The one sequence of a pooling request, its parameters resolved for `model`; an encoder's
    prompt is computed whole (Request.whole_prompt). Raises PoolingParamsError."""
    resolved = params.resolved(model.pooling, engine_type, model.hidden_size, model.encoder)
    _check_token_types(params.token_type_ids, len(prompt_token_ids), model)
    return Request(
        request_id,
        prompt_token_ids,
        POOLING_SAMPLING,
        frozenset(),  # no token ends it: its prompt's end does
        max_model_len,
        priority,
        cache_salt=cache_salt,
        pooling_params=resolved,
        whole_prompt=model.encoder,
    )


def _check_token_types(types: tuple[int, ...] | None, num_tokens: int, model: ModelConfig) -> None:
    if types is None:
        return
    if not model.encoder or model.type_vocab_size < 1:
        raise PoolingParamsError("token_type_ids", f"{model.name} has no token types (only BERT encoders do)")
    if len(types) != num_tokens:
        raise PoolingParamsError(
            "token_type_ids", f"token_type_ids has {len(types)} values for a prompt of {num_tokens} tokens"
        )
    if max(types, default=0) >= model.type_vocab_size:
        raise PoolingParamsError(
            "token_type_ids",
            f"token types must be below the model's type_vocab_size of {model.type_vocab_size}, got {max(types)}",
        )
