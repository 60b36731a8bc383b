"""A request's output constraint and tool plan, from its OpenAI / vLLM fields.

Constraints come from one of: OpenAI's `response_format`, vLLM's `structured_outputs`, vLLM's
older `guided_*` fields, or a tool_choice that forces a call (`required` or a named function,
whose arguments the grammar then makes valid). Two at once is a 400: silently preferring one
would return output the caller did not ask for.

The grammar is compiled here, in a worker thread, before the engine sees the request: a bad
schema is a 400 with the offending field, and the engine thread only meets a cache hit.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fornax.engine.structured.spec import GUIDED_FIELDS, StructuredOutputsError, StructuredOutputsParams
from fornax.server.errors import bad_request
from fornax.server.protocol import ChatCompletionRequest, CompletionRequest
from fornax.tools import ToolPlan, ToolsError, plan_tools


def tool_plan(req: ChatCompletionRequest, template: str | None, configured_parser: str | None) -> ToolPlan:
    """The request's tools/tool_choice checked (400 naming the field) and planned (tools/plan.py)."""
    try:
        return plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls, template, configured_parser)
    except ToolsError as exc:
        raise bad_request(str(exc), param=exc.param) from None


def constraint_of(
    req: ChatCompletionRequest | CompletionRequest, tools: ToolPlan | None = None
) -> StructuredOutputsParams | None:
    """The request's output constraint, or None for free text. 400 when it asks for two."""
    found: list[tuple[str, StructuredOutputsParams]] = []
    try:
        if req.response_format is not None and req.response_format.type != "text":
            found.append(("response_format", _from_response_format(req)))
        if req.structured_outputs is not None:
            found.append(("structured_outputs", _from_structured_outputs(req.structured_outputs)))
        for field, kind in GUIDED_FIELDS.items():
            value = getattr(req, field)
            if value is not None:
                found.append((field, StructuredOutputsParams(**{kind: value}, origin=field)))
        forced = tools.forced_constraint() if tools is not None else None
        if forced is not None:
            found.append(("tool_choice", forced))
    except StructuredOutputsError as exc:
        raise bad_request(str(exc), param=exc.param) from None
    if len(found) > 1:
        names = " and ".join(name for name, _ in found)
        raise bad_request(f"{names} each constrain the output; send only one", param=found[1][0])
    return found[0][1] if found else None


def _from_response_format(req: ChatCompletionRequest | CompletionRequest) -> StructuredOutputsParams:
    fmt = req.response_format
    assert fmt is not None
    if fmt.type == "json_object":
        return StructuredOutputsParams(json_object=True, origin="response_format")
    spec = fmt.json_schema
    if spec is None or spec.json_schema is None:
        raise StructuredOutputsError(
            "response_format.json_schema", "response_format of type json_schema needs json_schema.schema"
        )
    return StructuredOutputsParams(json=spec.json_schema, origin="response_format.json_schema")


def _from_structured_outputs(body: dict[str, Any]) -> StructuredOutputsParams:
    known = {"json", "regex", "choice", "grammar", "json_object", "disable_any_whitespace"}
    unknown = sorted(set(body) - known)
    if unknown:
        raise StructuredOutputsError(
            f"structured_outputs.{unknown[0]}",
            f"structured_outputs.{unknown[0]} is not supported (supported: {', '.join(sorted(known))})",
        )
    return StructuredOutputsParams(**body, origin="structured_outputs")


async def compile_constraint(compile_fn: Any, params: StructuredOutputsParams) -> None:
    """Compile (and cache) the grammar off the event loop; a 400 if it cannot be enforced."""
    try:
        await asyncio.to_thread(compile_fn, params)
    except StructuredOutputsError as exc:
        raise bad_request(str(exc), param=exc.param) from None
