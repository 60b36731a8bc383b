"""How one chat request uses its tools, decided once and shared by the server and `LLM.chat`.

`tool_choice` decides three things: whether the prompt shows the tools, whether a grammar
forces the output ("required" and a named function: the arguments then always validate
against the function's parameters), and which parser reads calls out of the output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fornax.engine.structured.spec import StructuredOutputsParams
from fornax.tools.calls import ToolCallParser, make_parser
from fornax.tools.prompt import check_tools, default_parser, forced_tool_schema, template_supports_tools


@dataclass
class ToolPlan:
    tools: list[dict[str, Any]] | None  # shown to the prompt; None: no tools in the prompt
    template_supports_tools: bool  # else tools/prompt.py's documented fallback renders them
    parser_name: str | None  # None: the output is plain content
    function_name: str | None = None  # the function tool_choice names
    forced_schema: dict[str, Any] | None = None  # the grammar's JSON schema when a call is forced

    def forced_constraint(self) -> StructuredOutputsParams | None:
        """The grammar constraint that forces the call (errors point at `tools`), or None."""
        if self.forced_schema is None:
            return None
        return StructuredOutputsParams(json=self.forced_schema, origin="tools")

    def new_parser(self) -> ToolCallParser | None:
        """A fresh parser for one generated sequence (None: no tool calls to read)."""
        if self.parser_name is None:
            return None
        if self.parser_name == "named":
            return make_parser("named", name=self.function_name)
        return make_parser(self.parser_name)


def plan_tools(
    tools: list[dict[str, Any]] | None,
    tool_choice: Any,
    parallel_tool_calls: bool,
    template: str | None,
    configured_parser: str | None = None,
) -> ToolPlan:
    """Raises ToolsError (a ValueError naming the field) for tools or a tool_choice that is wrong."""
    check_tools(tools, tool_choice)
    supports = template_supports_tools(template or "")
    choice = tool_choice if tool_choice is not None else ("auto" if tools else "none")
    if not tools or choice == "none":
        # "none": the model is not told about the tools, so it cannot try to call one.
        return ToolPlan(None, supports, None)
    if choice == "auto":
        return ToolPlan(tools, supports, configured_parser or default_parser(template))
    forced = forced_tool_schema(tools, choice, parallel_tool_calls)
    assert forced is not None
    schema, parser = forced
    name = choice["function"]["name"] if parser == "named" else None
    return ToolPlan(tools, supports, parser, function_name=name, forced_schema=schema)


def tool_finish_reason(called: bool, finish_reason: str | None) -> str | None:
    """OpenAI ends a turn that called tools with "tool_calls"; a cut-off one stays "length"."""
    return "tool_calls" if called and finish_reason == "stop" else finish_reason
