"""One chat turn, whichever API asked for it: the conversation rendered through the model's
chat template, its tools and output constraint planned, and the generation started.

Chat completions, OpenAI's Responses and Anthropic's Messages (server/api.py,
server/openai_responses.py, server/anthropic_messages.py) each translate their request into a
`ChatCompletionRequest` and call `start_chat`; each then shapes the same `ChatRun` into its own
answer, reading reasoning, text and tool calls apart with `ChatRun.splitter()`.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from fornax.engine.async_engine import AsyncEngine
from fornax.engine.structured.spec import StructuredOutputsParams
from fornax.server.errors import bad_request
from fornax.server.generation import Generation
from fornax.server.limits import (
    build_sampling_params,
    check_messages,
    check_text_fits,
    message_texts,
    resolve_max_tokens,
)
from fornax.server.openai_format import TokenText
from fornax.server.protocol import ChatCompletionRequest
from fornax.server.serving import require_generation, start_generation
from fornax.server.state import ServerState
from fornax.server.structured import compile_constraint, constraint_of, tool_plan
from fornax.tools import ToolPlan, prepare_messages
from fornax.tools.output import OutputSplitter
from fornax.tools.reasoning import (
    ReasoningFormat,
    default_reasoning_parser,
    opened_by_prompt,
    reasoning_format,
)

# Template variables that switch a model's thinking on or off: Qwen3's and DeepSeek-V3.1's names.
THINKING_SWITCHES = ("enable_thinking", "thinking")


@dataclass
class ChatRun:
    """A started chat generation and what is needed to read its output."""

    gen: Generation
    tools: ToolPlan
    reasoning: ReasoningFormat | None  # None: no reasoning is split out
    continued: str  # the text the output continues: the prompt, or the continued final message
    text: TokenText
    echo: str  # prepended to each choice's content (chat's `echo` with a continued message)
    show_reasoning: bool = True  # false: the reasoning is split off and dropped (include_reasoning)

    def splitter(self) -> OutputSplitter:
        """A fresh reader for one choice's text: reasoning first, then tool calls in the answer."""
        parser = self.reasoning.new_parser(self.continued) if self.reasoning is not None else None
        return OutputSplitter(parser, self.tools.new_parser(), keep_reasoning=self.show_reasoning)


def reasoning_of(
    req: ChatCompletionRequest, template: str | None, configured: str | None
) -> ReasoningFormat | None:
    """The reasoning format for this request: the server's --reasoning-parser, else the one the
    template implies (None: the output is all answer)."""
    name = configured if configured is not None else default_reasoning_parser(template)
    if name is None or name == "none":
        return None
    return reasoning_format(name)


def thinking_kwargs(req: ChatCompletionRequest) -> dict[str, Any]:
    """The template variables the request sets: its chat_template_kwargs, and OpenAI's
    `reasoning_effort` as the thinking switch ("none" turns it off, any effort on)."""
    kwargs = dict(req.chat_template_kwargs or {})
    if req.reasoning_effort is not None:
        on = req.reasoning_effort != "none"
        for name in THINKING_SWITCHES:
            kwargs.setdefault(name, on)
    return kwargs


async def start_chat(
    request: Request,
    state: ServerState,
    engine: AsyncEngine,
    req: ChatCompletionRequest,
    k: int | None,
    *,
    prefix: str = "chatcmpl",
    endpoint: str = "chat",
) -> ChatRun:
    """Check, render and admit one chat request (400s name the chat field at fault)."""
    require_generation(engine, request.state.served_model)
    template = engine.tokenizer.chat_template
    tools = tool_plan(req, template, state.config.tool_call_parser)
    reasoning = reasoning_of(req, template, state.config.reasoning_parser)
    constraint = constraint_of(req, tools)
    prompt, ids, continued_message = await render_prompt(state, engine, req, tools)
    continued = continued_message if continued_message is not None else prompt
    use_new = req.max_completion_tokens is not None
    max_tokens = resolve_max_tokens(
        req.max_completion_tokens if use_new else req.max_tokens,
        len(ids),
        engine.max_model_len,
        state.config,
        "max_completion_tokens" if use_new else "max_tokens",
    )
    if constraint is not None:
        constraint = _after_reasoning(constraint, reasoning, continued, template, thinking_kwargs(req))
        await compile_constraint(engine.compile_grammar, constraint)
    params = build_sampling_params(req, max_tokens, k, engine.model_config.vocab_size, constraint)
    gen = start_generation(state, request, engine, prefix, endpoint, [ids], params, req.priority, req.stream)
    gen.prompt_logprobs_shown = req.prompt_logprobs
    echo = continued_message if req.echo and continued_message is not None else ""
    return ChatRun(gen, tools, reasoning, continued, TokenText(engine.tokenizer), echo, req.include_reasoning)


async def render_prompt(
    state: ServerState, engine: AsyncEngine, req: ChatCompletionRequest, tools: ToolPlan
) -> tuple[str, list[int], str | None]:
    """The prompt a chat request is run on: (its text, its token ids, the continued final
    message's text or None). Messages' count_tokens counts exactly this."""
    messages = check_messages(req.messages, state.config)
    check_text_fits(message_texts(messages), engine.max_model_len, "messages")
    continued_message = _check_continuation(req, messages)
    # Templates without tool support get the tools and the tool turns as text (tools/prompt.py).
    messages = prepare_messages(messages, tools.tools, tools.template_supports_tools)
    template_tools = tools.tools if tools.template_supports_tools else None
    try:
        prompt = await asyncio.to_thread(
            _render,
            engine,
            messages,
            req.add_generation_prompt,
            template_tools,
            thinking_kwargs(req),
            continued_message,
        )
        ids = await asyncio.to_thread(engine.tokenizer.encode, prompt, False)
    except ValueError as exc:  # ChatTemplateError: missing, broken or over-budget template
        raise bad_request(str(exc), param="messages") from None
    return prompt, ids, continued_message


def _check_continuation(req: ChatCompletionRequest, messages: list[dict[str, Any]]) -> str | None:
    """The final assistant message's text when the request continues it (or echoes it), else None."""
    last = messages[-1]
    if req.continue_final_message:
        if req.add_generation_prompt:
            raise bad_request(
                "'continue_final_message' and 'add_generation_prompt' cannot both be true: "
                "set add_generation_prompt to false",
                param="continue_final_message",
            )
        if last["role"] != "assistant":
            raise bad_request(
                "'continue_final_message' needs the last message to be the assistant's",
                param="continue_final_message",
            )
        return str(last["content"])
    return str(last["content"]) if req.echo and last["role"] == "assistant" else None


def _render(
    engine: AsyncEngine,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
    tools: list[dict[str, Any]] | None,
    kwargs: dict[str, Any],
    continued: str | None,
) -> str:
    """The prompt text. Continuing the final message cuts the render right after that message's
    text, so whatever the template closes a turn with is left off, as transformers does."""
    text = engine.tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tools=tools, tokenize=False, **kwargs
    )
    assert isinstance(text, str)
    if continued is None:
        return text
    body = continued.strip()
    at = text.rfind(body) if body else -1
    if at < 0:
        raise bad_request(
            "the chat template does not write the final message's text as given, so it cannot be continued",
            param="continue_final_message",
        )
    return text[: at + len(body)]


def _after_reasoning(
    constraint: StructuredOutputsParams,
    reasoning: ReasoningFormat | None,
    continued: str,
    template: str | None,
    kwargs: dict[str, Any],
) -> StructuredOutputsParams:
    """The constraint holds for the answer, not the thinking: when the output will reason first,
    the grammar starts after the end tag. It will when the prompt opened the reasoning, the format
    always starts in it, or the template thinks by default and the request did not switch it off."""
    if reasoning is None:
        return constraint
    thinks = reasoning.starts_in_reasoning or opened_by_prompt(continued, reasoning)
    if not thinks and reasoning.name == "qwen3" and template and "enable_thinking" in template:
        thinks = kwargs.get("enable_thinking", True) is not False
    if not thinks:
        return constraint
    constraint.starts_after = reasoning.end
    return constraint
