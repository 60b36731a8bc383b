"""Tools on the way in: request checks, tools in the prompt, and the schema that forces a call.

Templates that know about tools (they read the `tools` variable) get the conversation as
transformers' templates expect it. Templates that do not get a fallback: the tool list goes into the
system message in hermes' format, and earlier calls and results are written out as text in the same
format, so the model sees one consistent convention and `HermesParser` can read what it writes.
"""

from __future__ import annotations

import json
import re
from typing import Any, ClassVar

import jinja2
import jinja2.meta
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols

__all__ = [
    "MAX_TOOLS",
    "ToolsError",
    "check_tools",
    "default_parser",
    "forced_tool_schema",
    "prepare_messages",
    "template_supports_tools",
]

MAX_TOOLS = 128  # OpenAI's limit
_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")


class ToolsError(ValueError):
    """A malformed `tools` or `tool_choice`; `param` names the offending field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


# ---- checks --------------------------------------------------------------------------------------


def _check_tool(i: int, tool: Any) -> str:
    """One entry of `tools`; returns its function name."""
    where = f"tools[{i}]"
    if not isinstance(tool, dict):
        raise ToolsError(where, f"{where} must be an object, got {type(tool).__name__}")
    if tool.get("type") != "function":
        raise ToolsError(f"{where}.type", f"{where}.type must be 'function', got {tool.get('type')!r}")
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise ToolsError(f"{where}.function", f"{where}.function must be an object")
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ToolsError(
            f"{where}.function.name",
            f"{where}.function.name must be 1 to 64 letters, digits, '_' or '-', got {name!r}",
        )
    if "description" in fn and fn["description"] is not None and not isinstance(fn["description"], str):
        raise ToolsError(f"{where}.function.description", f"{where}.function.description must be a string")
    if "parameters" in fn and fn["parameters"] is not None and not isinstance(fn["parameters"], dict):
        raise ToolsError(
            f"{where}.function.parameters", f"{where}.function.parameters must be a JSON schema object"
        )
    return name


def _choice_name(tool_choice: Any) -> str | None:
    """The function a named tool_choice names; None for the string choices."""
    if isinstance(tool_choice, dict):
        return tool_choice["function"]["name"]
    return None


def check_tools(tools: Any, tool_choice: Any) -> None:
    """Raises ToolsError unless `tools` and `tool_choice` are a well-formed OpenAI pair.

    An absent or empty `tools` means no tools (the server has always accepted `[]`).
    """
    if tools is not None and not isinstance(tools, list):
        raise ToolsError("tools", f"tools must be an array of function tools, got {type(tools).__name__}")
    tools = tools or []
    if len(tools) > MAX_TOOLS:
        raise ToolsError("tools", f"tools has {len(tools)} entries; at most {MAX_TOOLS} are allowed")
    seen: dict[str, int] = {}
    for i, tool in enumerate(tools):
        name = _check_tool(i, tool)
        if name in seen:
            raise ToolsError(
                f"tools[{i}].function.name",
                f"tools[{i}].function.name {name!r} is already the name of tools[{seen[name]}]",
            )
        seen[name] = i

    if tool_choice is None or tool_choice in ("none", "auto"):
        return
    if tool_choice == "required":
        if not tools:
            raise ToolsError("tool_choice", "tool_choice 'required' needs at least one tool in tools")
        return
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if (
        not isinstance(tool_choice, dict)
        or tool_choice.get("type") != "function"
        or not isinstance(fn, dict)
        or not isinstance(fn.get("name"), str)
    ):
        raise ToolsError(
            "tool_choice",
            "tool_choice must be 'none', 'auto', 'required' or "
            '{"type": "function", "function": {"name": ...}}, got ' + json.dumps(tool_choice, default=str),
        )
    if fn["name"] not in seen:
        where = "no tools were given" if not tools else f"tools has no function named {fn['name']!r}"
        raise ToolsError("tool_choice.function.name", f"tool_choice names {fn['name']!r} but {where}")


# ---- templates -----------------------------------------------------------------------------------


class _GenerationBlock(Extension):
    """Accepts transformers' `{% generation %}...{% endgeneration %}` so such templates parse."""

    tags: ClassVar[set[str]] = {"generation"}

    def parse(self, parser: Any) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def template_supports_tools(template: str) -> bool:
    """Whether a chat template reads the `tools` variable (so it renders tool lists itself).
    A template that does not parse cannot render anything, tools included: False."""
    env = jinja2.Environment(extensions=[loopcontrols, _GenerationBlock])
    try:
        ast = env.parse(template)
    except jinja2.TemplateError:
        return False
    return "tools" in jinja2.meta.find_undeclared_variables(ast)


def default_parser(template: str | None) -> str:
    """The call format a model probably writes, judged from its chat template: Llama 3's templates
    mention `<|python_tag|>` or the `ipython` role; hermes' format otherwise, which is also the one
    the fallback prompt teaches."""
    if template and ("<|python_tag|>" in template or "ipython" in template):
        return "llama3_json"
    return "hermes"


# ---- messages ------------------------------------------------------------------------------------

_FALLBACK_INSTRUCTIONS = """\
You can call functions to help answer the user. Their signatures, as JSON, are inside <tools></tools>:
<tools>
{signatures}
</tools>

To call a function, reply with this block for each call, with the arguments as a JSON object:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>
Each function's result will be given back to you inside <tool_response></tool_response>."""


def _arguments_object(arguments: Any) -> Any:
    """A call's arguments as a mapping when they are JSON text of one (OpenAI sends a string;
    templates index into it). Anything else is passed on unchanged."""
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except ValueError:
            return arguments
        return parsed if isinstance(parsed, dict) else arguments
    return arguments


def _normalized_calls(tool_calls: list[Any]) -> list[dict[str, Any]]:
    calls = []
    for call in tool_calls:
        fn = call.get("function") or {}
        calls.append(
            {
                "id": call.get("id"),
                "type": "function",
                "function": {"name": fn.get("name"), "arguments": _arguments_object(fn.get("arguments"))},
            }
        )
    return calls


def _text(content: Any) -> str:
    """Message content as text: content-part lists joined, None as empty."""
    if content is None:
        return ""
    if isinstance(content, list):
        return "\n".join(str(p.get("text") or "") for p in content if isinstance(p, dict))
    return str(content)


def _with_instructions(content: Any, instructions: str) -> Any:
    if content is None or content == "":
        return instructions
    if isinstance(content, list):
        return [*content, {"type": "text", "text": instructions}]
    return f"{content}\n\n{instructions}"


def _call_blocks(tool_calls: list[dict[str, Any]]) -> str:
    blocks = []
    for call in tool_calls:
        fn = call["function"]
        body = json.dumps({"name": fn["name"], "arguments": fn["arguments"]}, ensure_ascii=False)
        blocks.append(f"<tool_call>\n{body}\n</tool_call>")
    return "\n".join(blocks)


def prepare_messages(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, template_supports: bool
) -> list[dict[str, Any]]:
    """The conversation as the chat template should see it (the input is not modified).

    `template_supports`: the template renders tools itself (see template_supports_tools); then only
    earlier calls' arguments change, from JSON text to mappings, as transformers' templates expect.
    Otherwise tools and earlier calls and results become text in hermes' format: the tool list is
    added to the system message, assistant calls become `<tool_call>` blocks in the assistant's
    content, and `tool` results become user messages of `<tool_response>` blocks (a run of results
    is one user message, as the turn they answer was one assistant message).
    """
    if template_supports:
        out = []
        for message in messages:
            if message.get("role") == "assistant" and message.get("tool_calls"):
                message = {**message, "tool_calls": _normalized_calls(message["tool_calls"])}
            out.append(dict(message))
        return out

    out = []
    results: dict[str, Any] | None = None  # the user message collecting the current run of results
    for message in messages:
        role = message.get("role")
        if role == "tool":
            response = f"<tool_response>\n{_text(message.get('content'))}\n</tool_response>"
            if results is None:
                results = {"role": "user", "content": response}
                out.append(results)
            else:
                results["content"] += "\n" + response
            continue
        results = None
        if role == "assistant" and message.get("tool_calls"):
            blocks = _call_blocks(_normalized_calls(message["tool_calls"]))
            text = _text(message.get("content"))
            rest = {k: v for k, v in message.items() if k != "tool_calls"}
            out.append({**rest, "content": f"{text}\n{blocks}" if text else blocks})
        else:
            out.append(dict(message))

    if tools:
        signatures = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
        instructions = _FALLBACK_INSTRUCTIONS.format(signatures=signatures)
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": _with_instructions(out[0].get("content"), instructions)}
        else:
            out.insert(0, {"role": "system", "content": instructions})
    return out


# ---- forced calls --------------------------------------------------------------------------------


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    """A function's parameters schema, made to require an object: arguments are always one, and the
    call parsers rely on it (a schema without a type would let a grammar produce `3`)."""
    params = tool["function"].get("parameters") or {}
    return params if "type" in params else {"type": "object", **params}


def forced_tool_schema(
    tools: list[dict[str, Any]], tool_choice: Any, parallel_tool_calls: bool
) -> tuple[dict[str, Any], str] | None:
    """(JSON schema the output must follow, parser name) when tool_choice forces a call; None when
    it leaves the model free ("none", "auto", absent). Expects check_tools to have passed.

    "required": an array of one call or more (exactly one unless parallel calls are allowed), each
    `{"name": <one of the tools>, "arguments": <its parameters>}`, read by `json_array`. A named
    function: that function's arguments object alone, read by `named`.
    """
    if tool_choice is None or tool_choice in ("none", "auto"):
        return None
    if tool_choice == "required":
        variants = [
            {
                "type": "object",
                "properties": {"name": {"const": tool["function"]["name"]}, "arguments": _parameters(tool)},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for tool in tools
        ]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": variants}}
        if not parallel_tool_calls:
            schema["maxItems"] = 1
        return schema, "json_array"
    name = _choice_name(tool_choice)
    for tool in tools:
        if tool["function"]["name"] == name:
            return _parameters(tool), "named"
    raise ToolsError("tool_choice.function.name", f"tool_choice names {name!r}, which is not in tools")
