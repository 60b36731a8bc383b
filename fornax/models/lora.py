"""LoRA adapters in PEFT's format, read and checked against the model they adapt (docs/lora.md).

A PEFT adapter directory holds adapter_config.json (rank `r`, `lora_alpha`, `use_rslora`,
`target_modules`, ...) and adapter_model.safetensors with, per adapted projection, `lora_A`
[r, in] and `lora_B` [out, r] under the HF module's name (`base_model.model.` in front). The
projections an adapter may target are the decoder's q/k/v/o and gate/up/down: the ones
`linear_sources()` fuses into the model's Linears, so each adapted HF module is one part (a
row range) of one Linear. Everything an adapter could get wrong is checked here, before any
slot is touched, and told as an AdapterError (HTTP 400): a bad adapter changes nothing.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load

from fornax.config import ModelConfig
from fornax.layers.linear import Linear
from fornax.layers.lora import LoRASlots, LoRAStepState
from fornax.layers.native import load_lora_kernel

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# The HF module names an adapter may target, and the rows each has in the fused Linear.
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Bounds that keep a file from asking for unbounded work before its shapes are checked.
MAX_CONFIG_BYTES = 1 << 20
_KEY = re.compile(r"^(?P<module>.+\.(?P<target>[a-z_]+))\.lora_(?P<side>[AB])\.weight$")


class AdapterError(ValueError):
    """An adapter that cannot serve on this model, and why (a 400: the caller's file)."""


def _part_rows(config: ModelConfig, target: str) -> int:
    if target == "q_proj":
        return config.num_attention_heads * config.head_dim
    if target in ("k_proj", "v_proj"):
        return config.num_key_value_heads * config.head_dim
    if target in ("gate_proj", "up_proj"):
        return config.intermediate_size
    return config.hidden_size  # o_proj, down_proj


@dataclass(frozen=True)
class AdaptedLinear:
    """One Linear an adapter may target: its HF module names (one per fused part), in order."""

    linear: Linear
    modules: tuple[str, ...]
    parts: tuple[int, ...]  # output rows of each part


def adaptable_linears(model: torch.nn.Module, config: ModelConfig) -> list[AdaptedLinear]:
    """The decoder's projections that adapters may target (the LM head is not one; nor, yet,
    a mixture-of-experts layer's experts, whose widths are not the dense MLP's)."""
    out = []
    for linear, names in model.linear_sources():
        if any(".experts." in n or ".shared_expert." in n for n in names):
            continue  # a mixture-of-experts layer's experts: not adaptable yet (attention is)
        modules = tuple(n.removesuffix(".weight") for n in names)
        targets = [m.rsplit(".", 1)[-1] for m in modules]
        if all(t in TARGETS for t in targets):
            out.append(AdaptedLinear(linear, modules, tuple(_part_rows(config, t) for t in targets)))
    return out


def attach_slots(
    model: torch.nn.Module, config: ModelConfig, max_loras: int, max_rank: int, native: bool = True
) -> LoRAStepState:
    """Give every adaptable Linear its (empty) slots; the returned state is what the runner sets
    per step. Memory: max_loras x max_rank x (in + out) per projection, in float32 (layers/lora.py says why)."""
    state = LoRAStepState()
    kernel = load_lora_kernel() if native else None
    for target in adaptable_linears(model, config):
        slots = LoRASlots(state, target.linear.in_features, target.parts, max_loras, max_rank, kernel)
        target.linear.lora = slots
    return state


@dataclass
class LoRAAdapter:
    """An adapter read and checked, held on the host until a slot takes it.

    key: a digest of its files, mixed into its requests' prefix-cache hashes (two adapters with
    the same bytes may share KV; different ones never do, whatever their names, across
    restarts too). weights: per adaptable Linear (adaptable_linears' order), per part, the
    (A, B) pair or None; `scaling` is applied as a slot takes it."""

    name: str
    path: str
    key: str
    rank: int
    scaling: float
    weights: list[list[tuple[torch.Tensor, torch.Tensor] | None]]

    @property
    def nbytes(self) -> int:
        pairs = [pair for parts in self.weights for pair in parts if pair is not None]
        return sum(a.nbytes + b.nbytes for a, b in pairs)


def _read_config(directory: Path) -> dict:
    path = directory / CONFIG_FILE
    if not path.is_file():
        raise AdapterError(f"{directory}: no {CONFIG_FILE} (a PEFT LoRA adapter directory is expected)")
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise AdapterError(f"{path}: larger than {MAX_CONFIG_BYTES} bytes")
    try:
        config = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise AdapterError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{path}: expected a JSON object")
    return config


def _check_config(config: dict, where: str, max_rank: int) -> tuple[int, float]:
    """(rank, scaling) from a PEFT config, refusing what this engine does not apply."""
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{where}: peft_type {config.get('peft_type')!r} is not LORA")
    r, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise AdapterError(f"{where}: r must be a positive integer, got {r!r}")
    if r > max_rank:
        raise AdapterError(f"{where}: rank {r} is over this server's limit of {max_rank} (--max-lora-rank)")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise AdapterError(f"{where}: lora_alpha must be a number, got {alpha!r}")
    unsupported = {
        "use_dora": "DoRA",
        "modules_to_save": "modules_to_save (full copies of other modules)",
        "rank_pattern": "per-module ranks (rank_pattern)",
        "alpha_pattern": "per-module alphas (alpha_pattern)",
        "layers_to_transform": "layers_to_transform",
    }
    for key, what in unsupported.items():
        if config.get(key):
            raise AdapterError(f"{where}: {what} is not supported")
    if config.get("bias", "none") != "none":
        raise AdapterError(
            f"{where}: adapters with trained biases (bias={config['bias']!r}) are not supported"
        )
    scaling = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
    return r, float(scaling)


def _target_names(config: dict) -> set[str] | None:
    """The projection names target_modules asks for (None: a regex or "all-linear" names no
    list; the tensors then say what is adapted)."""
    targets = config.get("target_modules")
    if isinstance(targets, str) or targets is None:
        return None
    names = {str(t).rsplit(".", 1)[-1] for t in targets}
    unknown = names - set(TARGETS)
    if unknown:
        raise AdapterError(f"target_modules {sorted(unknown)}: only {', '.join(TARGETS)} can be adapted")
    return names


def _module_name(key: str) -> str:
    """A PEFT tensor key's module as linear_sources names it: `base_model.model.` dropped, and
    a multimodal wrapper's `language_model.` (Gemma 3's conditional-generation class) too."""
    name = key.removeprefix("base_model.model.")
    return name.replace("model.language_model.", "model.", 1)


def read_adapter(
    name: str, path: str | Path, model: torch.nn.Module, config: ModelConfig, max_rank: int
) -> LoRAAdapter:
    """Read a PEFT LoRA directory and check it against `model`: every tensor a known target of
    an existing layer with the shapes the model's projections have, both matrices present,
    ranks as configured, every target the config names present in every layer."""
    directory = Path(path)
    try:
        is_dir = directory.is_dir()
    except (OSError, ValueError) as exc:  # a path no file system takes (a NUL byte, too long)
        raise AdapterError(f"{str(directory)[:200]!r}: not a usable path ({exc})") from None
    if not is_dir:
        raise AdapterError(f"{directory}: not a directory")
    peft_config = _read_config(directory)
    rank, scaling = _check_config(peft_config, str(directory / CONFIG_FILE), max_rank)
    wanted = _target_names(peft_config)
    weights_path = directory / WEIGHTS_FILE
    if not weights_path.is_file():
        raise AdapterError(f"{directory}: no {WEIGHTS_FILE}")
    try:
        data = weights_path.read_bytes()  # read once: parsed here, and digested for the cache key
        tensors = load(data)
    except (SafetensorError, OSError, ValueError) as exc:
        raise AdapterError(f"{weights_path}: not a readable safetensors file ({exc})") from None

    linears = adaptable_linears(model, config)
    where: dict[str, tuple[int, int]] = {}  # HF module -> (linear index, part index)
    for li, target in enumerate(linears):
        for pi, module in enumerate(target.modules):
            where[module] = (li, pi)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise AdapterError(f"{weights_path}: tensor {key!r} is not a LoRA A/B matrix of a projection")
        module = _module_name(m["module"])
        if module not in where:
            raise AdapterError(
                f"{weights_path}: {key!r} targets {module!r}, which this model has no adaptable projection for"
            )
        pairs.setdefault(module, {})[m["side"]] = tensor

    weights: list[list[tuple[torch.Tensor, torch.Tensor] | None]] = [[None] * len(t.parts) for t in linears]
    for module, sides in pairs.items():
        if set(sides) != {"A", "B"}:
            raise AdapterError(f"{weights_path}: {module} has lora_{''.join(sides)} without its other matrix")
        li, pi = where[module]
        target = linears[li]
        a, b = sides["A"], sides["B"]
        want_a = (rank, target.linear.in_features)
        want_b = (target.parts[pi], rank)
        if tuple(a.shape) != want_a or tuple(b.shape) != want_b:
            raise AdapterError(
                f"{weights_path}: {module} has A {tuple(a.shape)} and B {tuple(b.shape)}; this model needs "
                f"A {want_a} and B {want_b} (rank {rank}): an adapter for another base model, or another rank"
            )
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise AdapterError(f"{weights_path}: {module} holds non-finite values")
        weights[li][pi] = (a.float(), b.float())
    if not pairs:
        raise AdapterError(f"{weights_path}: no LoRA matrices")
    if wanted is not None:  # each named target in every layer: a missing one is a damaged file
        for target in linears:
            for module in target.modules:
                if module.rsplit(".", 1)[-1] in wanted and module not in pairs:
                    raise AdapterError(
                        f"{weights_path}: target {module} is named in {CONFIG_FILE} but has no weights"
                    )
    digest = hashlib.sha256(data)
    digest.update(json.dumps(peft_config, sort_keys=True).encode())
    return LoRAAdapter(name, str(directory), digest.hexdigest(), rank, scaling, weights)


def write_slot(model: torch.nn.Module, config: ModelConfig, slot: int, adapter: LoRAAdapter | None) -> None:
    """Put `adapter` into `slot` of every adaptable Linear (None: empty the slot)."""
    for i, target in enumerate(adaptable_linears(model, config)):
        slots = target.linear.lora
        assert slots is not None, "attach_slots first"
        if adapter is None:
            slots.clear(slot)
        else:
            slots.write(slot, adapter.weights[i], adapter.scaling)
