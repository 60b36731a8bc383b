"""LoRA adapters in the engine (docs/lora.md): slots.py keeps the books (no torch), serving.py
ties them to a model's projections."""

from fornax.engine.lora.slots import LoRARegistry, LoRARequest, LoRASlotTable

__all__ = ["LoRARegistry", "LoRARequest", "LoRASlotTable"]
