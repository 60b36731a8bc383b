"""The server's OpenAPI document at /openapi.json, with the request bodies it really takes.

The routes read their bodies themselves (bounded reads, parsing off the event loop:
server/body_parser.py), so FastAPI cannot see the body models. This adds them: each POST route's
requestBody points at its pydantic model's JSON schema, so clients, generators and the
schema-driven test (tests/server/test_openapi_campaign.py) know what to send. Bearer keys
are declared too; /health is the one route without them.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from fornax.server.anthropic_protocol import MessagesCountTokensRequest, MessagesRequest
from fornax.server.embeddings import EmbeddingRequest, RerankRequest, ScoreRequest
from fornax.server.lora_routes import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from fornax.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from fornax.server.responses_protocol import ResponsesRequest

REQUEST_BODIES: dict[str, type[BaseModel]] = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
    "/tokenize": TokenizeRequest,
    "/detokenize": DetokenizeRequest,
    "/v1/fornax/tokens": TokenizeRequest,
    "/v1/messages": MessagesRequest,
    "/v1/messages/count_tokens": MessagesCountTokensRequest,
    "/v1/responses": ResponsesRequest,
    "/v1/embeddings": EmbeddingRequest,
    "/v1/rerank": RerankRequest,
    "/v1/score": ScoreRequest,
    "/v1/load_lora_adapter": LoadLoRAAdapterRequest,
    "/v1/unload_lora_adapter": UnloadLoRAAdapterRequest,
}
_REF = "#/components/schemas/{model}"
# One working body per route: documentation for a reader, and the explicit case that a
# schema-driven test sends before its generated ones.
_EXAMPLES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {
        "messages": [{"role": "user", "content": "What is LLM inference?"}],
        "max_tokens": 4,
    },
    "/v1/completions": {"prompt": "LLM inference is", "max_tokens": 4},
    "/tokenize": {"prompt": "LLM inference is"},
    "/detokenize": {"tokens": [1, 2, 3]},
    "/v1/fornax/tokens": {"messages": [{"role": "user", "content": "What is LLM inference?"}]},
    "/v1/messages": {"messages": [{"role": "user", "content": "What is LLM inference?"}], "max_tokens": 4},
    "/v1/messages/count_tokens": {"messages": [{"role": "user", "content": "What is LLM inference?"}]},
    "/v1/responses": {"input": "What is LLM inference?", "max_output_tokens": 4},
    "/v1/embeddings": {"input": ["What is LLM inference?", "Serving a model's weights."]},
    "/v1/rerank": {"query": "What is LLM inference?", "documents": ["Serving weights.", "A recipe."]},
    "/v1/score": {"text_1": "What is LLM inference?", "text_2": ["Serving weights.", "A recipe."]},
    "/v1/load_lora_adapter": {"lora_name": "sql", "lora_path": "/adapters/sql"},
    "/v1/unload_lora_adapter": {"lora_name": "sql"},
}
PUBLIC_PATHS = frozenset({"/health"})


def install_openapi(app: FastAPI, model_names: tuple[str, ...]) -> None:
    """Make `app.openapi()` (served at app.openapi_url) describe the bodies and the auth;
    `model` fields list the names this server serves (any other is a 404)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = _build(app, model_names)
        return app.openapi_schema

    app.openapi = openapi


def _build(app: FastAPI, model_names: tuple[str, ...]) -> dict[str, Any]:
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    components = schema.setdefault("components", {})
    models = components.setdefault("schemas", {})
    for path, model in REQUEST_BODIES.items():
        operation = schema["paths"].get(path, {}).get("post")
        if operation is None:
            continue
        body = model.model_json_schema(ref_template=_REF)
        if "model" in body.get("properties", {}):
            body["properties"]["model"] = {"anyOf": [{"enum": list(model_names)}, {"type": "null"}]}
        models.update(body.pop("$defs", {}))
        models[model.__name__] = body
        example = _EXAMPLES[path] | (
            {"model": model_names[0]} if "model" in body.get("properties", {}) else {}
        )
        media = {"schema": {"$ref": _REF.format(model=model.__name__)}, "example": example}
        operation["requestBody"] = {"required": True, "content": {"application/json": media}}
    components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    for path, item in schema["paths"].items():
        for operation in item.values():
            operation["security"] = [] if path in PUBLIC_PATHS else [{"bearer": []}]
    return schema
