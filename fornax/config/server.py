"""The HTTP server's frozen config, and one served model's."""

from __future__ import annotations

from dataclasses import dataclass

from fornax.config.common import DEFAULT_MODEL, ConfigError
from fornax.config.engine import EngineConfig
from fornax.config.keys import PREFIX_CACHE_SCOPES, RateLimit


@dataclass(frozen=True)
class ServerConfig:
    """The HTTP server: where it listens, who may call it and how much one request may ask for."""

    host: str = "127.0.0.1"
    port: int = 8000
    served_model_names: tuple[str, ...] = (DEFAULT_MODEL,)  # the first is the name in responses
    api_keys: tuple[tuple[str, str], ...] = ()  # (name, key); empty: the server is open
    # Operators' keys: everything a user key may do, plus /admin/*. With keys configured and
    # none of these, /admin/* answers 403 to everyone (server/tenancy.py).
    admin_keys: tuple[tuple[str, str], ...] = ()
    # Prefix-cache sharing: "global" (every request may hit every cached prefix) or "key"
    # (a key's requests only hit its own). None: "key" when any key is configured.
    prefix_cache_scope: str | None = None
    # Requests and tokens per minute by key name; "*": every key not named. (): no limits.
    rate_limits: tuple[tuple[str, RateLimit], ...] = ()
    public_metrics: bool = False
    access_log: bool = True
    log_level: str = "info"
    shutdown_timeout_s: float = 30.0  # in-flight requests get this long to finish on SIGTERM
    # Per-request bounds: each is a flag of `fornax serve`.
    max_queued_requests: int = 256  # waiting requests beyond this get 429
    # Admission counts work, not HTTP requests: 64 prompts x n=16 queue 1,024 sequences, and
    # cost sum over prompts of (prompt tokens + n * max_tokens) against the per-request budget.
    max_queued_sequences: int = 1024
    max_request_tokens: int = 1 << 20
    # Key names that may send negative priorities (scheduled ahead of everyone's default 0).
    # Admin keys may too, and anyone when the server has no keys at all (no tenants to protect).
    privileged_keys: tuple[str, ...] = ()
    max_body_bytes: int = 4 << 20
    max_n: int = 16
    max_tokens_limit: int | None = None  # None: up to the context; larger requests are clamped
    max_stop_strings: int = 16
    max_stop_string_chars: int = 256
    max_logit_bias: int = 300
    max_top_logprobs: int = 20
    max_messages: int = 1024
    max_prompts: int = 64  # prompts in one /v1/completions batch
    retry_after_s: int = 1
    # How `tool_choice: "auto"` output is read (fornax/tools/calls.py): "hermes", "llama3_json";
    # None picks by the chat template.
    tool_call_parser: str | None = None
    # How reasoning is split from the answer (fornax/tools/reasoning.py): "qwen3", "deepseek_r1",
    # "none" (never); None picks by the chat template.
    reasoning_parser: str | None = None
    # Several models (server/model_set.py): None loads every one at start-up; K loads them on
    # first request and keeps at most K, unloading the least recently used idle one.
    max_loaded_models: int | None = None
    model_load_timeout_s: float = 300.0  # how long a request waits for its model to load
    # Responses API responses kept for GET and previous_response_id, all keys together
    # (server/response_store.py); 0 keeps none.
    max_stored_responses: int = 1000

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ConfigError(f"port must be in [0, 65535], got {self.port}")
        if not self.served_model_names:
            raise ConfigError("at least one served model name is needed")
        for name in ("max_queued_requests", "max_stop_strings", "max_logit_bias", "max_stored_responses"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0")
        for name in (
            "max_body_bytes",
            "max_n",
            "max_stop_string_chars",
            "max_messages",
            "max_prompts",
            "max_queued_sequences",
            "max_request_tokens",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1")
        if self.max_tokens_limit is not None and self.max_tokens_limit < 1:
            raise ConfigError("max_tokens_limit must be at least 1")
        if not 0 <= self.max_top_logprobs <= 20:
            raise ConfigError("max_top_logprobs must be in [0, 20] (the engine's bound)")
        if self.shutdown_timeout_s < 0:
            raise ConfigError("shutdown_timeout_s must be >= 0")
        if self.max_loaded_models is not None and self.max_loaded_models < 1:
            raise ConfigError("max_loaded_models must be at least 1")
        if self.model_load_timeout_s <= 0:
            raise ConfigError("model_load_timeout_s must be positive")
        self._check_tenancy()

    def _check_tenancy(self) -> None:
        """Roles, cache scope and rate limits agree with the keys (and resolve the scope)."""
        user_names, admin_names = {n for n, _ in self.api_keys}, {n for n, _ in self.admin_keys}
        both = sorted(user_names & admin_names)
        if both:  # one name is one tenant with one role: usage and limits are counted by name
            raise ConfigError(f"key name(s) {both} are given both as a user key and as an admin key")
        if {k for _, k in self.api_keys} & {k for _, k in self.admin_keys}:
            raise ConfigError("the same secret is given both as a user key and as an admin key")
        if self.prefix_cache_scope is None:
            scope = "key" if self.api_keys or self.admin_keys else "global"
            object.__setattr__(self, "prefix_cache_scope", scope)  # still being built
        if self.prefix_cache_scope not in PREFIX_CACHE_SCOPES:
            raise ConfigError(
                f"prefix_cache_scope must be one of {', '.join(PREFIX_CACHE_SCOPES)}, "
                f"got {self.prefix_cache_scope!r}"
            )
        known = (user_names | admin_names) or {"anonymous"}  # no keys: every client is "anonymous"
        unknown = sorted({n for n, _ in self.rate_limits} - known - {"*"})
        if unknown:
            raise ConfigError(f"rate limits name unknown key(s) {unknown}; configured: {sorted(known)}")


@dataclass(frozen=True)
class ServedModelConfig:
    """One model of a server that serves several (server/model_set.py)."""

    names: tuple[str, ...]  # what clients send as `model`; the first is the name in responses
    engine: EngineConfig
