"""The output of a Responses API reply as OpenAI's output items, and the stream events that
build them (server/openai_responses.py answers with them).

`OutputBuilder` is fed the pieces `OutputSplitter` reads out of a choice's text (reasoning,
answer text, call fragments) and keeps the items: a `reasoning` item, the `message`, one
`function_call` per call. A streamed reply sends the events it returns; a whole one is built by
the same builder from the same pieces and sends none, so the two agree item for item.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from fornax.tools.output import Piece


@dataclass
class OutputItem:
    """One output item being built: a reasoning item, the message, or a function call."""

    kind: str  # "reasoning" | "message" | "function_call"
    id: str
    index: int
    text: str = ""  # the reasoning, the message's text or the call's arguments
    call_id: str = ""
    name: str = ""
    status: str = "in_progress"
    done: bool = False

    def render(self, whole: bool = True) -> dict[str, Any]:
        """The item as the API shows it; `whole` false: as first announced (no text yet)."""
        text = self.text if whole else ""
        if self.kind == "reasoning":
            content = [{"type": "reasoning_text", "text": text}] if whole else []
            return {
                "id": self.id,
                "type": "reasoning",
                "summary": [],
                "content": content,
                "status": self.status,
            }
        if self.kind == "message":
            return {
                "id": self.id,
                "type": "message",
                "role": "assistant",
                "status": self.status,
                "content": [_output_text(text)] if whole else [],
            }
        return {
            "id": self.id,
            "type": "function_call",
            "call_id": self.call_id,
            "name": self.name,
            "arguments": text,
            "status": self.status,
        }


def _output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputBuilder:
    """A choice's split pieces -> output items, with the stream events that build them.

    An item opens when it first has something to show: reasoning or answer text that is not
    only whitespace (held until then, so blank text makes no item), a call's first fragment.
    The reasoning item is done when the answer starts; the others when the output ends.
    """

    def __init__(self) -> None:
        self.items: list[OutputItem] = []
        self._reasoning: OutputItem | None = None
        self._message: OutputItem | None = None
        self._calls: dict[int, OutputItem] = {}
        self._held_reasoning = self._held_content = ""

    def feed(self, piece: Piece) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if piece.reasoning:
            events += self._reasoning_text(piece.reasoning)
        if piece.content:
            events += self._content(piece.content)
        for delta in piece.calls:
            call = self._calls.get(delta.index)
            if call is None:
                events += self._close_reasoning()
                call = self._calls[delta.index] = self._open("function_call", "fc")
                call.call_id, call.name = delta.id or "", delta.name or ""
                events.append(self._added(call))
            if delta.arguments:
                call.text += delta.arguments
                events.append(
                    {
                        "type": "response.function_call_arguments.delta",
                        "item_id": call.id,
                        "output_index": call.index,
                        "delta": delta.arguments,
                    }
                )
        return events

    def finish(self, finish_reason: str | None) -> list[dict[str, Any]]:
        """The done events of every open item; the last one is incomplete when the output was cut."""
        open_items = [item for item in self.items if not item.done]
        events: list[dict[str, Any]] = []
        for item in open_items:
            cut = finish_reason != "stop" and item is self.items[-1]
            events += self._close(item, "incomplete" if cut else "completed")
        return events

    def _reasoning_text(self, text: str) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        item = self._reasoning
        if item is None:
            self._held_reasoning += text
            if not self._held_reasoning.strip() or self.items:  # blank so far, or the answer began
                return []
            item = self._reasoning = self._open("reasoning", "rs")
            text, self._held_reasoning = self._held_reasoning, ""
            events += [self._added(item), self._part("added", item)]
        elif item.done:  # the answer has begun: a parser never goes back to reasoning
            return []
        item.text += text
        events.append(
            {
                "type": "response.reasoning_text.delta",
                "item_id": item.id,
                "output_index": item.index,
                "content_index": 0,
                "delta": text,
            }
        )
        return events

    def _content(self, text: str) -> list[dict[str, Any]]:
        item = self._message
        events: list[dict[str, Any]] = []
        if item is None:
            self._held_content += text
            if not self._held_content.strip():
                return []
            events += self._close_reasoning()
            item = self._message = self._open("message", "msg")
            text, self._held_content = self._held_content, ""
            events += [self._added(item), self._part("added", item)]
        item.text += text
        events.append(
            {
                "type": "response.output_text.delta",
                "item_id": item.id,
                "output_index": item.index,
                "content_index": 0,
                "delta": text,
                "logprobs": [],
            }
        )
        return events

    def _open(self, kind: str, prefix: str) -> OutputItem:
        item = OutputItem(kind, _new_id(prefix), len(self.items))
        self.items.append(item)
        return item

    def _close_reasoning(self) -> list[dict[str, Any]]:
        item = self._reasoning
        return self._close(item, "completed") if item is not None and not item.done else []

    def _close(self, item: OutputItem, status: str) -> list[dict[str, Any]]:
        item.done, item.status = True, status
        head = {"item_id": item.id, "output_index": item.index}
        events: list[dict[str, Any]]
        if item.kind == "function_call":
            events = [
                {
                    "type": "response.function_call_arguments.done",
                    **head,
                    "name": item.name,
                    "arguments": item.text,
                }
            ]
        elif item.kind == "reasoning":
            events = [
                {"type": "response.reasoning_text.done", **head, "content_index": 0, "text": item.text},
                self._part("done", item),
            ]
        else:
            events = [
                {
                    "type": "response.output_text.done",
                    **head,
                    "content_index": 0,
                    "text": item.text,
                    "logprobs": [],
                },
                self._part("done", item),
            ]
        events.append(
            {"type": "response.output_item.done", "output_index": item.index, "item": item.render()}
        )
        return events

    def _added(self, item: OutputItem) -> dict[str, Any]:
        return {
            "type": "response.output_item.added",
            "output_index": item.index,
            "item": item.render(whole=False),
        }

    def _part(self, stage: str, item: OutputItem) -> dict[str, Any]:
        text = item.text if stage == "done" else ""
        part = {"type": "reasoning_text", "text": text} if item.kind == "reasoning" else _output_text(text)
        return {
            "type": f"response.content_part.{stage}",
            "item_id": item.id,
            "output_index": item.index,
            "content_index": 0,
            "part": part,
        }
