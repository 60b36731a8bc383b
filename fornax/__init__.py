"""fornax: an LLM inference engine and OpenAI-compatible server."""

from fornax.engine.request import SamplingParams
from fornax.llm import LLM
from fornax.outputs import CompletionOutput, RequestOutput

__version__ = "0.1.0"
__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams", "__version__"]
