"""fornax: an LLM inference engine and OpenAI-compatible server.

The public names are imported lazily (PEP 562), so that importing a torch-free module
such as `fornax.engine.scheduler` does not pull in torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = [
    "LLM",
    "CompletionOutput",
    "EmbeddingRequestOutput",
    "LoRARequest",
    "PoolingParams",
    "RequestOutput",
    "SamplingParams",
    "ScoringRequestOutput",
    "__version__",
]

_LAZY = {
    "LLM": "fornax.llm",
    "LoRARequest": "fornax.engine.lora",
    "SamplingParams": "fornax.engine.request",
    "PoolingParams": "fornax.engine.pooling",
    "EmbeddingRequestOutput": "fornax.request_output",
    "CompletionOutput": "fornax.request_output",
    "RequestOutput": "fornax.request_output",
    "ScoringRequestOutput": "fornax.request_output",
}

if TYPE_CHECKING:
    from fornax.engine.lora import LoRARequest
    from fornax.engine.pooling import PoolingParams
    from fornax.engine.request import SamplingParams
    from fornax.llm import LLM
    from fornax.request_output import (
        CompletionOutput,
        EmbeddingRequestOutput,
        RequestOutput,
        ScoringRequestOutput,
    )


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'fornax' has no attribute {name!r}")
