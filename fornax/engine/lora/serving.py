"""An engine's adapters: the registry, the slots on the model, and what a request names.

Built by the engine core when its config has `lora` (EngineConfig.lora); the core hands the
slot table to the scheduler and the step state to the runner, and asks `resolve` which adapter
a request runs with.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from fornax.config import LoRAConfig, ModelConfig, check_adapter_name
from fornax.engine.lora.slots import LoRARegistry, LoRARequest, LoRASlotTable
from fornax.engine.request import RequestRejected
from fornax.models.lora import AdapterError, LoRAAdapter, attach_slots, read_adapter

logger = logging.getLogger("fornax.lora")
__all__ = ["AdapterError", "EngineLoRA", "resolve_adapter"]  # AdapterError: what the server catches


class EngineLoRA:
    def __init__(
        self, config: LoRAConfig, model: torch.nn.Module, model_config: ModelConfig, native: bool = True
    ) -> None:
        """native: the products through kernels/lora.c where the library builds (else torch)."""
        if model_config.encoder:
            raise AdapterError(f"{model_config.name} is an encoder: LoRA adapters apply to decoder models")
        self.config, self.model, self.model_config = config, model, model_config
        self.registry = LoRARegistry()
        self.slots = LoRASlotTable(config.max_loras)
        self.state = attach_slots(model, model_config, config.max_loras, config.max_lora_rank, native)
        for name, path in config.adapters:
            self.load(name, path)

    def load(self, name: str, path: str | Path) -> LoRAAdapter:
        """Read, check and register an adapter (AdapterError or RequestRejected: nothing changed).
        Its weights reach a slot when a request first runs with it."""
        try:
            check_adapter_name(name)
        except ValueError as exc:
            raise AdapterError(str(exc)) from None
        if self.registry.get(name) is not None:
            raise AdapterError(f"an adapter named {name!r} is already loaded; unload it first")
        adapter = read_adapter(name, path, self.model, self.model_config, self.config.max_lora_rank)
        self.registry.add(adapter)
        logger.info(
            "LoRA adapter %s: rank %d, %.1f MiB, from %s", name, adapter.rank, adapter.nbytes / 2**20, path
        )
        return adapter

    def unload(self, name: str) -> None:
        """New requests can no longer pick it; those running with it finish (KeyError: unknown)."""
        self.registry.remove(name)

    def resolve(self, lora: str | LoRARequest | None) -> LoRAAdapter | None:
        """The adapter a request names (None: the base model); an unknown name is refused, a
        LoRARequest with a path loads it first."""
        if lora is None:
            return None
        if isinstance(lora, LoRARequest):
            adapter = self.registry.get(lora.lora_name)
            if adapter is None and lora.lora_path is not None:
                adapter = self.load(lora.lora_name, lora.lora_path)
            name = lora.lora_name
        else:
            adapter, name = self.registry.get(lora), lora
        if adapter is None:
            raise RequestRejected(
                f"no LoRA adapter named {name!r} is loaded (loaded: {self.registry.names()})"
            )
        return adapter


def resolve_adapter(lora_engine: EngineLoRA | None, lora: str | LoRARequest | None) -> LoRAAdapter | None:
    """What a request's `lora` names on an engine that may serve no adapters at all."""
    if lora is None:
        return None
    if lora_engine is None:
        raise RequestRejected("this engine serves no LoRA adapters (start it with --lora or --enable-lora)")
    return lora_engine.resolve(lora)
