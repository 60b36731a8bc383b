"""Chat templates rendered as untrusted code: jinja2's immutable sandbox, with a time and size budget.

A chat template comes with the model file, so it may be broken or hostile. Every render runs in
`ImmutableSandboxedEnvironment`, with a deadline checked at every loop iteration, call and big
operator, and a size budget checked on every value built and on the output. Any failure, whatever
its cause, surfaces as one `ChatTemplateError` with a message that says which.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime
from typing import Any, ClassVar

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

RENDER_TIMEOUT_S = 2.0
MAX_TEMPLATE_OUTPUT = 1 << 20  # chars allowed beyond 4x the size of the input conversation
_MAX_INT_BITS = 1 << 16  # `**` results above this many bits are refused (10**10**10 would never end)


class ChatTemplateError(ValueError):
    """A chat template that is missing, broken, hostile or over budget; the message says which."""


def flatten_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI content-part lists become one string, so string-only templates keep working."""
    flat = []
    for message in messages:
        if not isinstance(message, dict):
            raise ChatTemplateError(f"each message must be an object, got {type(message).__name__}")
        content = message.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text":
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise ChatTemplateError(f"unsupported message content part {kind!r}; only text works")
                texts.append(str(part.get("text") or ""))
            message = {**message, "content": "\n".join(texts)}
        flat.append(message)
    return flat


# ---- sandboxed, bounded chat template rendering -------------------------------------------------


@dataclass(frozen=True)
class _Budget:
    deadline: float
    max_chars: int


# The budget of the render running in this thread/task; the sandbox hooks below have no other way
# to reach it, since jinja calls them without the render's variables.
_BUDGET: ContextVar[_Budget | None] = ContextVar("fornax_chat_template_budget", default=None)


def _tick() -> None:
    budget = _BUDGET.get()
    if budget is not None and time.monotonic() > budget.deadline:
        raise ChatTemplateError(f"chat template took longer than {RENDER_TIMEOUT_S:g}s to render")


def _check_count(count: int) -> None:
    budget = _BUDGET.get()
    if budget is not None and count > budget.max_chars:
        raise ChatTemplateError(f"chat template built a value larger than {budget.max_chars} items")


def _check_size(value: Any) -> Any:
    if isinstance(value, str | list | tuple | dict):
        _check_count(len(value))
    return value


def _loop_guard(iterable: Any) -> Iterator[Any]:
    """Wraps every `{% for %}` iterable, so each iteration checks the deadline (jinja's loop helper
    lists the rest of an iterator when `loop.length` is asked for, so all loop features still work)."""
    for item in iterable:
        _tick()
        yield item


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, plus checks of time and size at every call, lookup and big operator."""

    intercepted_binops = frozenset({"*", "**"})

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        _tick()
        if (
            operator == "**"
            and isinstance(left, int)
            and isinstance(right, int)
            and abs(left) > 1
            and right > 0
            and abs(left).bit_length() * right > _MAX_INT_BITS
        ):
            raise ChatTemplateError("chat template computed a number that is too large")
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, str | list | tuple) and isinstance(n, int):
                    _check_count(len(seq) * n)
        return super().call_binop(context, operator, left, right)

    def call(self, context: Any, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        _tick()
        return _check_size(super().call(context, obj, *args, **kwargs))

    def getattr(self, obj: Any, attribute: str) -> Any:
        return _check_size(super().getattr(obj, attribute))

    def getitem(self, obj: Any, argument: Any) -> Any:
        return _check_size(super().getitem(obj, argument))


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` (transformers marks assistant spans with it):
    renders its body unchanged."""

    tags: ClassVar[set[str]] = {"generation"}

    def parse(self, parser: Any) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"chat template error: {message}")


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Not jinja's own tojson, which HTML-escapes <, > and &: prompts must show them verbatim.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _guard_filter(fn: Callable[..., Any]) -> Callable[..., Any]:
    # Integer parameters (not the filtered value itself, which may well be a big number) are
    # checked up front: a width like center(10**10) allocates before any other hook runs.
    first_param = 2 if getattr(fn, "jinja_pass_arg", None) else 1  # after the context, if passed

    @functools.wraps(fn)  # keeps jinja's pass_context/pass_environment markers
    def guarded(*args: Any, **kwargs: Any) -> Any:
        _tick()
        for arg in (*args[first_param:], *kwargs.values()):
            if isinstance(arg, int) and not isinstance(arg, bool):
                _check_count(abs(arg))
        return _check_size(fn(*args, **kwargs))

    return guarded


def _make_environment() -> _BoundedSandbox:
    env = _BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, loopcontrols])
    env.filters["tojson"] = _tojson
    env.filters = {name: _guard_filter(fn) for name, fn in env.filters.items()}
    env.globals.update(
        raise_exception=_raise_exception,
        strftime_now=_strftime_now,
        _fornax_loop_guard=_loop_guard,
    )
    return env


_ENV = _make_environment()


@functools.lru_cache(maxsize=32)
def _compile(source: str) -> jinja2.Template:
    try:
        tree = _ENV.parse(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"chat template does not parse (line {exc.lineno}): {exc.message}") from None
    # Loops without calls inside them would otherwise never reach a sandbox hook.
    for loop in tree.find_all(nodes.For):
        guard = nodes.Name("_fornax_loop_guard", "load", lineno=loop.lineno)
        loop.iter = nodes.Call(guard, [loop.iter], [], None, None, lineno=loop.lineno)
    return _ENV.from_string(tree)


def render_chat_template(source: str, context: dict[str, Any]) -> str:
    """Render `source` with `context` inside the sandbox, within RENDER_TIMEOUT_S and a size budget
    of MAX_TEMPLATE_OUTPUT plus 4x the size of the input. Any failure is a ChatTemplateError."""
    token = _BUDGET.set(None)
    try:
        input_size = len(json.dumps(context, default=str, ensure_ascii=False))
        budget = _Budget(time.monotonic() + RENDER_TIMEOUT_S, MAX_TEMPLATE_OUTPUT + 4 * input_size)
        _BUDGET.set(budget)
        template = _compile(source)
        chunks, size = [], 0
        for chunk in template.generate(**context):
            size += len(chunk)
            if size > budget.max_chars:
                raise ChatTemplateError(f"chat template output exceeds {budget.max_chars} characters")
            _tick()
            chunks.append(chunk)
        return "".join(chunks)
    except ChatTemplateError:
        raise
    except Exception as exc:
        raise ChatTemplateError(f"chat template failed: {type(exc).__name__}: {exc}") from None
    finally:
        _BUDGET.reset(token)
