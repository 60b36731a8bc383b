"""Loading and unloading LoRA adapters while serving (docs/lora.md), under vLLM's names:
`POST /v1/load_lora_adapter` {lora_name, lora_path} and `POST /v1/unload_lora_adapter`
{lora_name}, for admin keys only (auth.Gate). Requests then pick an adapter with `model: name`.

An adapter is read and checked off the event loop (a file of any size, checked against the
model: models/lora.py); a bad one is a 400 with the reason and changes nothing. Unloading
turns new requests away at once and lets those already running with it finish.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from fornax.engine.lora.serving import AdapterError
from fornax.server.body_parser import parse_body
from fornax.server.errors import ApiError, bad_request
from fornax.server.model_set import ServedModel
from fornax.server.serving import server_state

router = APIRouter()  # its paths are admin-only: auth.ADMIN_PATHS


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)
    # fornax: which served model it adapts (default: the first, where --lora puts adapters)
    base_model: str | None = Field(default=None, max_length=256)


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1, max_length=256)
    lora_int_id: int | None = None  # vLLM's field, accepted and unused: names identify adapters


def _base(request: Request, name: str | None) -> ServedModel:
    models = server_state(request).models
    model = models.find(name) if name else models.primary
    if model.engine is None or model.engine.core.lora is None:
        raise bad_request(
            f"the model '{model.name}' serves no LoRA adapters (start the server with --enable-lora or --lora)",
            param="base_model",
            code="lora_disabled",
        )
    return model


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(request: Request) -> Response:
    state = server_state(request)
    req = await parse_body(request, LoadLoRAAdapterRequest, state.config.max_body_bytes)
    model = _base(request, req.base_model)
    if req.lora_name in state.models.by_name or req.lora_name in state.models.adapters:
        raise bad_request(
            f"the name '{req.lora_name}' is already in use", param="lora_name", code="name_in_use"
        )
    lora = model.engine.core.lora
    try:
        await asyncio.to_thread(lora.load, req.lora_name, Path(req.lora_path))
    except AdapterError as exc:
        raise bad_request(str(exc), param="lora_path", code="invalid_adapter") from None
    state.models.adapters[req.lora_name] = model
    model.runtime_adapters[req.lora_name] = req.lora_path  # loaded again if the model reloads
    model.metrics.on_adapter(req.lora_name, loaded=True)
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(request: Request) -> Response:
    state = server_state(request)
    req = await parse_body(request, UnloadLoRAAdapterRequest, state.config.max_body_bytes)
    model = state.models.adapters.get(req.lora_name)
    if model is None:
        raise ApiError(
            404,
            f"no LoRA adapter named '{req.lora_name}' is loaded",
            param="lora_name",
            code="adapter_not_found",
        )
    del state.models.adapters[req.lora_name]
    model.runtime_adapters.pop(req.lora_name, None)
    lora = model.engine.core.lora if model.engine is not None else None
    if lora is not None and lora.registry.get(req.lora_name) is not None:
        lora.unload(req.lora_name)
    model.metrics.on_adapter(req.lora_name, loaded=False)
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")
