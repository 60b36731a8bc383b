"""ServerArgs: every `fornax serve` setting of the HTTP server, each once, with its flag and help.

The engine's settings are EngineArgs' (engine_args.py); `add_serve_args` puts both on a
parser in the order the help has always read. `fornax serve` turns the namespace into a
ServerConfig (`create_server_config`), and `fornax cluster up` renders the settings it passes
on to each replica from the same fields (`as_argv`), so a flag added here reaches the
replicas without a second list. The defaults are ServerConfig's (fornax/config/server.py, their one home).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from typing import Any

from fornax.config import (
    DEFAULT_MODEL,
    PREFIX_CACHE_SCOPES,
    ConfigError,
    ServerConfig,
    load_admin_keys,
    load_api_keys,
    load_key_limits,
)
from fornax.engine_args import ENGINE, LORA, MODEL, SPECULATIVE, TIERS, EngineArgs
from fornax.flag_fields import add_fields, as_argv, flag_field

SERVER, LIMITS = "server", "per-request limits"
RATE_LIMITS = "per-key rate limits (429 with Retry-After when exceeded; see /admin/usage)"
TOOL_CALL_PARSERS = ("auto", "hermes", "llama3_json")
REASONING_PARSERS = ("auto", "none", "qwen3", "deepseek_r1")
LOG_LEVELS = ("debug", "info", "warning", "error")


def _default(name: str) -> Any:
    return ServerConfig.__dataclass_fields__[name].default


def _arg(default: Any, help: str | None = None, *, group: str = SERVER, **kwargs: Any) -> Any:
    return flag_field(default, help, group=group, **kwargs)


def _limit(name: str) -> Any:
    """A per-request bound: its flag is its ServerConfig field's name."""
    return _arg(_default(name), group=LIMITS, type=int)


@dataclass(frozen=True)
class ServerArgs:
    """The server's settings as the flags give them; field names are the flags' dests."""

    host: str = _arg(_default("host"))
    port: int = _arg(_default("port"), type=int)
    # Repeated flags: None when not given (argparse cannot append to a tuple default), a tuple when
    # read back (from_cli_args), so the settings stay immutable.
    served_model_name: tuple[str, ...] | None = _arg(
        None,
        "name(s) clients use for the model (repeatable; default: the model argument); "
        "with several models, one per model, in their order",
        action="append",
    )
    max_loaded_models: int | None = _arg(
        _default("max_loaded_models"),
        "load models on first request and keep at most K, unloading the least recently used idle one "
        "(default: all loaded at start-up)",
        type=int,
        metavar="K",
    )
    model_load_timeout: float = _arg(
        _default("model_load_timeout_s"), "seconds a request waits for its model to load", type=float
    )
    api_key: tuple[str, ...] | None = _arg(
        None,
        "a user's key, optionally name:key (repeatable); users see only their own requests",
        action="append",
    )
    api_key_file: str | None = _arg(None, "file with one user key (or name:key) per line")
    admin_key: tuple[str, ...] | None = _arg(
        None,
        "an operator's key, name:key (repeatable; also FORNAX_ADMIN_KEY): everything a user key may do, "
        "plus /admin/* and every request in /v1/fornax/events and /live. With keys but no admin key, "
        "/admin/* answers 403 to all",
        action="append",
    )
    admin_key_file: str | None = _arg(None, "file with one admin key (or name:key) per line")
    prefix_cache_scope: str | None = _arg(
        _default("prefix_cache_scope"),
        "key: a key's requests reuse only its own cached prompt blocks, so cached_tokens reveals nothing "
        "about other keys' prompts; global: all share one cache (default: key when any key is "
        "configured, else global)",
        choices=list(PREFIX_CACHE_SCOPES),
    )
    key_limits: str | None = _arg(
        None,
        'JSON: {"alice": {"requests_per_minute": 60, "tokens_per_minute": 20000}, "*": {...every other '
        "key...}}; a key's entry overrides the defaults field by field (null: unlimited)",
        group=RATE_LIMITS,
        metavar="FILE",
    )
    rate_limit_rpm: int | None = _arg(
        None,
        "default requests per minute for every key (over any 60 s window)",
        group=RATE_LIMITS,
        type=int,
        metavar="N",
    )
    rate_limit_tpm: int | None = _arg(
        None,
        "default tokens per minute for every key: a request reserves its prompt plus max_tokens per "
        "choice when admitted, corrected to the tokens used when it ends",
        group=RATE_LIMITS,
        type=int,
        metavar="M",
    )
    public_metrics: bool = _arg(False, "serve /metrics without a key", action="store_true")
    access_log: bool = _arg(_default("access_log"), action=argparse.BooleanOptionalAction)
    log_level: str = _arg(_default("log_level"), choices=list(LOG_LEVELS))
    shutdown_timeout: float = _arg(
        _default("shutdown_timeout_s"), "seconds in-flight requests get to finish on SIGTERM", type=float
    )
    tool_call_parser: str = _arg(
        "auto",
        "how tool calls are read from output under tool_choice=auto (auto: by chat template)",
        choices=list(TOOL_CALL_PARSERS),
    )
    reasoning_parser: str = _arg(
        "auto",
        "how reasoning (<think>...</think>) is split from the answer as reasoning_content "
        "(auto: by chat template; none: never)",
        choices=list(REASONING_PARSERS),
    )
    max_stored_responses: int = _arg(
        _default("max_stored_responses"),
        "Responses API responses kept for GET and previous_response_id, all keys together; when full, "
        "the key holding the most loses its least recently used (0: none kept)",
        type=int,
        metavar="N",
    )
    max_queued_requests: int = _limit("max_queued_requests")
    max_body_bytes: int = _limit("max_body_bytes")
    max_n: int = _limit("max_n")
    max_tokens_limit: int | None = _limit("max_tokens_limit")
    max_stop_strings: int = _limit("max_stop_strings")
    max_stop_string_chars: int = _limit("max_stop_string_chars")
    max_logit_bias: int = _limit("max_logit_bias")
    max_top_logprobs: int = _limit("max_top_logprobs")
    max_messages: int = _limit("max_messages")
    max_prompts: int = _limit("max_prompts")
    max_queued_sequences: int = _limit("max_queued_sequences")
    max_request_tokens: int = _limit("max_request_tokens")
    privileged_key: tuple[str, ...] | None = _arg(
        None,
        "key name that may send negative priorities (repeatable; admin keys may too)",
        group=LIMITS,
        action="append",
        metavar="NAME",
    )

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        add_fields(cls, parser, own_group=SERVER, groups=(SERVER, RATE_LIMITS, LIMITS))

    @classmethod
    def from_cli_args(cls, namespace: argparse.Namespace) -> ServerArgs:
        given = {f.name: getattr(namespace, f.name) for f in fields(cls) if hasattr(namespace, f.name)}
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in given.items()})

    def as_argv(self, exclude: tuple[str, ...] = ()) -> list[str]:
        """The settings that differ from the defaults, as flags (engine_args.py's as_argv)."""
        return as_argv(self, exclude=exclude)

    def api_keys(self) -> tuple[tuple[str, str], ...]:
        return load_api_keys(self.api_key or [], self.api_key_file)

    def admin_keys(self) -> tuple[tuple[str, str], ...]:
        return load_admin_keys(self.admin_key or [], self.admin_key_file)

    def create_server_config(self, served_model_names: tuple[str, ...]) -> ServerConfig:
        """The ServerConfig these settings give (key files read, limits parsed) for a server
        whose first model answers to `served_model_names`."""
        limits = {f.name: getattr(self, f.name) for f in fields(self) if f.metadata["group"] == LIMITS}
        limits["privileged_keys"] = tuple(limits.pop("privileged_key") or ())
        return ServerConfig(
            host=self.host,
            port=self.port,
            served_model_names=served_model_names,
            max_loaded_models=self.max_loaded_models,
            model_load_timeout_s=self.model_load_timeout,
            api_keys=self.api_keys(),
            admin_keys=self.admin_keys(),
            prefix_cache_scope=self.prefix_cache_scope,
            rate_limits=load_key_limits(self.key_limits, self.rate_limit_rpm, self.rate_limit_tpm),
            public_metrics=self.public_metrics,
            access_log=self.access_log,
            log_level=self.log_level,
            shutdown_timeout_s=self.shutdown_timeout,
            tool_call_parser=None if self.tool_call_parser == "auto" else self.tool_call_parser,
            reasoning_parser=None if self.reasoning_parser == "auto" else self.reasoning_parser,
            max_stored_responses=self.max_stored_responses,
            **limits,
        )


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """`fornax serve`'s flags (and `fornax cluster up`'s, which passes them on): the model's
    first, the server's, then the engine's groups, as the help has always read."""
    parser.add_argument("model_arg", nargs="?", default=None, metavar="MODEL", help="same as --model")
    EngineArgs.add_cli_args(parser, "serve", groups=(MODEL,))
    ServerArgs.add_cli_args(parser)
    EngineArgs.add_cli_args(parser, "serve", groups=(ENGINE, TIERS, SPECULATIVE, LORA))


def serve_models(args: argparse.Namespace) -> list[str]:
    """The models `fornax serve` was given: the positional one, then each --model."""
    models = ([args.model_arg] if args.model_arg else []) + list(args.model or [])
    return models or [DEFAULT_MODEL]


def served_names(models: list[str], given: list[str] | None) -> list[tuple[str, ...]]:
    """Each model's served names: for one model, every --served-model-name (aliases); for
    several, exactly one each, in order; by default the model argument itself."""
    if not given:
        return [(m,) for m in models]
    if len(models) == 1:
        return [tuple(given)]
    if len(given) != len(models):
        raise ConfigError(
            f"{len(models)} models need {len(models)} --served-model-name values, one per "
            f"model in order; got {len(given)}"
        )
    if len(set(given)) != len(given):
        raise ConfigError("--served-model-name values must differ between models")
    return [(n,) for n in given]
