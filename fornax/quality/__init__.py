"""Quality checks of the engine's numerics against a fixed real text (quantization, kernels)."""
