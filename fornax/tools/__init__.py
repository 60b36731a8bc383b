"""OpenAI tool calling at the text level, shared by the HTTP server and `LLM.chat`.

`calls`: reading calls out of generated text, streamed or whole. `prompt`: checking a request's
tools, putting them in the prompt, and the schema that forces a call.
"""

from __future__ import annotations

from fornax.tools.calls import (
    PARSERS,
    HermesParser,
    JsonArrayParser,
    Llama3JsonParser,
    NamedParser,
    ToolCall,
    ToolCallDelta,
    ToolCallParser,
    make_parser,
    new_call_id,
    parse_complete,
)
from fornax.tools.prompt import (
    MAX_TOOLS,
    ToolsError,
    check_tools,
    default_parser,
    forced_tool_schema,
    prepare_messages,
    template_supports_tools,
)

__all__ = [
    "MAX_TOOLS",
    "PARSERS",
    "HermesParser",
    "JsonArrayParser",
    "Llama3JsonParser",
    "NamedParser",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallParser",
    "ToolPlan",
    "ToolsError",
    "check_tools",
    "default_parser",
    "forced_tool_schema",
    "make_parser",
    "new_call_id",
    "parse_complete",
    "plan_tools",
    "prepare_messages",
    "template_supports_tools",
    "tool_finish_reason",
]
from fornax.tools.plan import ToolPlan, plan_tools, tool_finish_reason
