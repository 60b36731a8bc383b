"""What routing needs from a request body, and nothing more: the model, the prompt as text
(the prefix tree's key) and a cheap token estimate (the length policy's measure).

The key text is not what the replica tokenizes (no chat template is applied), but it is the
same function of the messages for every request, so two requests whose messages share a
prefix share a key prefix — which is all the prefix tree needs.

Token estimate: characters / 4, rounded up, for text (about right for English with BPE
vocabularies; no round trip to /tokenize on the hot path); the exact count for token ids.
"""

from __future__ import annotations

from typing import Any

CHARS_PER_TOKEN = 4
# Separators that do not occur in ordinary text: "user" + "hi" must not read as "useRhi".
_ROLE_END, _MESSAGE_END = "\x1f", "\x1e"


class RouteRequest:
    """Routing facts of one request. The prompt text and the token estimate are worked out
    on first use, so only the policies that read them pay (cache-aware: the text; length:
    the estimate); the others look at the model alone."""

    __slots__ = ("_body", "_text", "_tokens", "endpoint", "model")

    def __init__(self, endpoint: str, model: str | None, body: dict[str, Any] | None = None) -> None:
        self.endpoint = endpoint  # "chat", "completions", "responses", "messages", or another route's name
        self.model = model  # None: the request names none (every replica qualifies)
        self._body = body if endpoint in PROMPT_TEXT or endpoint == "completions" else None
        self._text: str | None = None
        self._tokens: int | None = None

    @property
    def text(self) -> str:
        """The prefix-tree key ("" for non-generation routes)."""
        if self._text is None:
            body = self._body or {}
            text_of = PROMPT_TEXT.get(self.endpoint)
            self._text = text_of(body) if text_of is not None else completion_text(body.get("prompt"))[0]
        return self._text

    @property
    def est_tokens(self) -> int:
        if self._tokens is None:
            if self.endpoint == "completions":
                self._tokens = completion_tokens((self._body or {}).get("prompt"))
            else:
                self._tokens = estimate_tokens(self.text)
        return self._tokens


def estimate_tokens(text: str) -> int:
    return -(-len(text) // CHARS_PER_TOKEN)


def route_request(endpoint: str, body: Any) -> RouteRequest:
    """Routing facts from a parsed body; a body of the wrong shape yields empty facts (the
    replica that gets it answers the 400)."""
    if not isinstance(body, dict):
        return RouteRequest(endpoint, None)
    model = body.get("model")
    return RouteRequest(endpoint, model if isinstance(model, str) and model else None, body)


def chat_text(messages: Any) -> str:
    if not isinstance(messages, list):
        return ""
    parts: list[str] = []
    for message in messages:
        if isinstance(message, dict):
            role = message.get("role")
            parts.append(
                f"{role if isinstance(role, str) else ''}{_ROLE_END}{_content(message.get('content'))}"
            )
    return _MESSAGE_END.join(parts)


def responses_text(body: dict[str, Any]) -> str:
    """The Responses API's `instructions` and `input` (a string or items) as chat_text reads
    messages: the same conversation gives the same key whichever chat-shaped API sent it. Items
    other than messages (a function call's output) count by their text."""
    items = body.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list):
        items = []
    instructions = body.get("instructions")
    system = [{"role": "system", "content": instructions}] if isinstance(instructions, str) else []
    messages = [
        item if "role" in item else {"role": str(item.get("type")), "content": item.get("output") or ""}
        for item in items
        if isinstance(item, dict)
    ]
    return chat_text(system + messages)


def messages_text(body: dict[str, Any]) -> str:
    """Anthropic's `system` (a string or text blocks) and `messages`, as chat_text reads them."""
    system = body.get("system")
    first = [{"role": "system", "content": system}] if isinstance(system, (str, list)) else []
    messages = body.get("messages")
    return chat_text(first + (messages if isinstance(messages, list) else []))


# The chat-shaped endpoints and how their bodies give the prefix-tree key.
PROMPT_TEXT = {
    "chat": lambda body: chat_text(body.get("messages")),
    "responses": responses_text,
    "messages": messages_text,
}


def _content(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: the text ones
        return "".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def completion_text(prompt: Any) -> tuple[str, int]:
    """(key text, estimated tokens) of a completions prompt: a string, token ids, or a batch
    of either (joined in order; the estimate is the batch's total)."""
    if isinstance(prompt, str):
        return prompt, estimate_tokens(prompt)
    if not isinstance(prompt, list) or not prompt:
        return "", 0
    if all(isinstance(t, int) for t in prompt):
        return _ids_text(prompt), len(prompt)
    texts = [completion_text(item)[0] if isinstance(item, (str, list)) else "" for item in prompt]
    return _MESSAGE_END.join(texts), completion_tokens(prompt)


def completion_tokens(prompt: Any) -> int:
    """completion_text's estimate without building the text."""
    if isinstance(prompt, str):
        return estimate_tokens(prompt)
    if not isinstance(prompt, list):
        return 0
    if all(isinstance(t, int) for t in prompt):
        return len(prompt)
    return sum(completion_tokens(item) for item in prompt if isinstance(item, (str, list)))


def _ids_text(ids: list[int]) -> str:
    return ",".join(map(str, ids)) + ","  # the trailing comma: [1, 2] is not a prefix of [1, 23]
