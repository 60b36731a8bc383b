"""A Hugging Face directory's own pooling: sentence-transformers' files and config.json's keys.

sentence-transformers saves an embedder as the transformer's directory plus modules.json, which
lists the modules its vectors pass through: the Transformer, then a Pooling module (its
config.json in, e.g., 1_Pooling/ names the mode), often a Normalize. sentence_bert_config.json
gives the longest input it was trained on. A config.json may mark a Matryoshka model
(`matryoshka_dimensions`, or `is_matryoshka`). A module that changes the vector otherwise
(Dense, a max or weighted pooling) is refused at load: serving without it would answer with
different vectors than the model's own library.

A sequence-classification config.json (a cross-encoder) gives its number of labels (`id2label`)
and, when sentence-transformers saved it, the activation its CrossEncoder applies
(`sentence_transformers.activation_fn`, or the older `sbert_ce_default_activation_function`);
absent, CrossEncoder's default: a sigmoid for one label, none for more.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fornax.config import ConfigError, PoolingConfig
from fornax.models.loader import ModelLoadError

# sentence-transformers' Pooling flags, and the pooling each one is.
_POOLING_MODES = {
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
    "pooling_mode_lasttoken": "last",
}
_UNSUPPORTED_MODES = (
    "pooling_mode_max_tokens",
    "pooling_mode_mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens",
)
_MODULES = ("Transformer", "Pooling", "Normalize")  # the last part of each module's type
# sentence-transformers' activation classes (torch.nn's), by the last part of their path.
_ACTIVATIONS = {"Sigmoid": "sigmoid", "Identity": "identity"}


def _read(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from None


def read_pooling_config(hf_dir: Path, raw: dict[str, Any]) -> PoolingConfig:
    """The model's own pooling (config/pooling.py); defaults where the directory says nothing."""
    matryoshka = raw.get("matryoshka_dimensions")
    dims = tuple(int(d) for d in matryoshka) if isinstance(matryoshka, list) else ()
    fields: dict[str, Any] = {
        "matryoshka": bool(dims) or bool(raw.get("is_matryoshka")),
        "matryoshka_dimensions": dims,
        **_classifier(hf_dir, raw),
    }
    settings = _read(hf_dir / "sentence_bert_config.json") or {}
    if settings.get("max_seq_length") is not None:
        fields["max_seq_length"] = int(settings["max_seq_length"])
    modules = _read(hf_dir / "modules.json")
    if isinstance(modules, list):
        kinds = [str(m.get("type", "")).rpartition(".")[2] for m in modules]
        unknown = [k for k in kinds if k not in _MODULES]
        if unknown:
            raise ModelLoadError(
                f"unsupported sentence-transformers module {unknown[0]!r} in {hf_dir / 'modules.json'}"
            )
        fields["normalize"] = "Normalize" in kinds
        for module, kind in zip(modules, kinds):
            if kind == "Pooling":
                fields["type"] = _pooling_mode(hf_dir / str(module.get("path", "")) / "config.json")
    try:
        return PoolingConfig(**fields)
    except ConfigError as exc:
        raise ModelLoadError(f"bad pooling config in {hf_dir}: {exc}") from None


def _pooling_mode(path: Path) -> str:
    config = _read(path) or {}
    mode = config.get("pooling_mode")  # newer files name it outright
    if isinstance(mode, str):
        mode = {"lasttoken": "last"}.get(mode, mode)
        if mode not in _POOLING_MODES.values():
            raise ModelLoadError(f"unsupported pooling mode {mode!r} in {path}")
        return mode
    on = [flag for flag in (*_POOLING_MODES, *_UNSUPPORTED_MODES) if config.get(flag)]
    if len(on) != 1 or on[0] not in _POOLING_MODES:
        raise ModelLoadError(
            f"unsupported pooling in {path}: {on or 'no mode'} (supported: mean, cls, last token)"
        )
    return _POOLING_MODES[on[0]]


def _classifier(hf_dir: Path, raw: dict[str, Any]) -> dict[str, Any]:
    """A sequence-classification model's head: its number of labels and score activation."""
    archs = raw.get("architectures") or []
    if not archs or not str(archs[0]).endswith("ForSequenceClassification"):
        return {}
    labels = raw.get("id2label")
    num_labels = len(labels) if isinstance(labels, dict) and labels else int(raw.get("num_labels", 2))
    settings = raw.get("sentence_transformers")
    path = settings.get("activation_fn") if isinstance(settings, dict) else None
    path = path or raw.get("sbert_ce_default_activation_function")
    if path is None:
        return {"num_labels": num_labels, "score_activation": "sigmoid" if num_labels == 1 else "identity"}
    activation = _ACTIVATIONS.get(str(path).rpartition(".")[2])
    if activation is None:
        supported = ", ".join(_ACTIVATIONS)
        raise ModelLoadError(
            f"unsupported cross-encoder activation {path!r} in {hf_dir} (supported: {supported})"
        )
    return {"num_labels": num_labels, "score_activation": activation}
