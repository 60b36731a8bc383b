"""LoRA adapters over the served model (docs/lora.md): how many are resident at once, the
largest rank they may have, and the adapters named at start.

An adapter adds B A x (scaled) to chosen projections of the base model, per request; its
weights live in one of `max_loras` slots, sized once for `max_lora_rank`, so serving more
adapters than slots swaps them in and out (engine/lora/) and never grows memory.
"""

from __future__ import annotations

from dataclasses import dataclass

from fornax.config.common import ConfigError

# vLLM's bounds: ranks above 512 are fine-tunes in all but name, and the slots are sized for
# the largest rank allowed whether or not an adapter uses it.
MAX_LORA_RANK_LIMIT = 512
MAX_LORAS_LIMIT = 64


@dataclass(frozen=True)
class LoRAConfig:
    """Present on an EngineConfig when adapters may be served (EngineConfig.lora)."""

    max_loras: int = 4  # adapters resident in slots at once; a step mixes any of them
    max_lora_rank: int = 16  # adapters of a larger rank are refused at load
    # (name, path) of the adapters registered at start: a PEFT directory each.
    adapters: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if not 1 <= self.max_loras <= MAX_LORAS_LIMIT:
            raise ConfigError(f"max_loras must be in [1, {MAX_LORAS_LIMIT}], got {self.max_loras}")
        if not 1 <= self.max_lora_rank <= MAX_LORA_RANK_LIMIT:
            raise ConfigError(
                f"max_lora_rank must be in [1, {MAX_LORA_RANK_LIMIT}], got {self.max_lora_rank}"
            )
        names = [name for name, _ in self.adapters]
        for name in names:
            check_adapter_name(name)
        if len(set(names)) != len(names):
            raise ConfigError(f"an adapter name is given twice: {sorted(names)}")


def check_adapter_name(name: str) -> None:
    """Adapters are picked by `model: name` in a request: a non-empty name of printable
    characters, without the '=' that separates it from its path on the command line."""
    if not name or len(name) > 256 or "=" in name or not name.isprintable() or name != name.strip():
        raise ConfigError(
            f"invalid adapter name {name!r}: 1-256 printable characters, no '=', no outer spaces"
        )


def parse_adapter_flag(value: str) -> tuple[str, str]:
    """`--lora NAME=PATH` -> (name, path)."""
    name, sep, path = value.partition("=")
    if not sep or not path:
        raise ConfigError(f"--lora takes NAME=PATH (a PEFT adapter directory), got {value!r}")
    check_adapter_name(name)
    return name, path
