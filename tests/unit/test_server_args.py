"""ServerArgs is the one source of the server's settings: every field is a flag of `fornax serve`
and `fornax cluster up`, every serve flag is a field (of ServerArgs or EngineArgs), the
defaults are ServerConfig's, and a replica's command line rendered from the fields reads back
to the same settings."""

from __future__ import annotations

import argparse
import json
from dataclasses import fields, replace

import pytest

from fornax.cli import build_parser
from fornax.cluster.cli import cluster_config
from fornax.config import DEFAULT_MODEL, RateLimit, ServerConfig
from fornax.engine_args import EngineArgs
from fornax.server_args import ServerArgs, add_serve_args

# serve flags that are neither a server nor an engine setting: the positional model and the
# cluster's replica count (cluster/cli.py).
NOT_SETTINGS = {"help", "model_arg", "replicas"}
# ServerConfig fields no flag sets: the names come from the model arguments, and Retry-After's
# seconds are the rate limiter's own.
NOT_FLAGS = {"served_model_names", "retry_after_s"}


def _serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    return parser


def test_every_field_is_a_flag_and_every_flag_a_field() -> None:
    dests = {a.dest for a in _serve_parser()._actions} - NOT_SETTINGS
    server = {f.name for f in fields(ServerArgs)}
    assert dests == server | EngineArgs.names()
    assert not server & EngineArgs.names()


def test_the_defaults_are_server_configs() -> None:
    assert ServerArgs().create_server_config((DEFAULT_MODEL,)) == ServerConfig()
    args = ServerArgs.from_cli_args(build_parser().parse_args(["serve"]))
    assert args == ServerArgs() and args.create_server_config((DEFAULT_MODEL,)) == ServerConfig()


def test_every_server_config_field_has_a_setting() -> None:
    """A ServerConfig field added without a flag fails here, unless NOT_FLAGS says why."""
    config = {f.name for f in fields(ServerConfig)} - NOT_FLAGS
    # the flags' names where they differ from the config's (a unit suffix, a plural)
    renamed = {
        "model_load_timeout_s": "model_load_timeout",
        "shutdown_timeout_s": "shutdown_timeout",
        "api_keys": "api_key",
        "admin_keys": "admin_key",
        "privileged_keys": "privileged_key",
        "rate_limits": "key_limits",
    }
    assert {renamed.get(n, n) for n in config} <= {f.name for f in fields(ServerArgs)}


def _every_server_flag(tmp_path) -> tuple[list[str], ServerConfig]:
    """Flags setting every server field away from its default, and the ServerConfig they give."""
    keys, admins, limits = tmp_path / "keys.txt", tmp_path / "admins.txt", tmp_path / "limits.json"
    keys.write_text("carol:-starts-with-a-dash\n")
    admins.write_text("root:sk-root\n")
    limits.write_text(json.dumps({"alice": {"requests_per_minute": 5}}))
    flags = [
        "--host",
        "0.0.0.0",
        "--port",
        "9001",
        "--served-model-name",
        "a",
        "--served-model-name",
        "b",
        "--max-loaded-models",
        "2",
        "--model-load-timeout",
        "12.5",
        "--api-key",
        "alice:sk-a",
        "--api-key-file",
        str(keys),
        "--admin-key",
        "ops:sk-ops",
        "--admin-key-file",
        str(admins),
        "--prefix-cache-scope",
        "global",
        "--key-limits",
        str(limits),
        "--rate-limit-rpm",
        "7",
        "--rate-limit-tpm",
        "900",
        "--public-metrics",
        "--no-access-log",
        "--log-level",
        "debug",
        "--shutdown-timeout",
        "3",
        "--tool-call-parser",
        "hermes",
        "--reasoning-parser",
        "qwen3",
        "--max-stored-responses",
        "10",
        "--max-queued-requests",
        "5",
        "--max-body-bytes",
        "1000",
        "--max-n",
        "2",
        "--max-tokens-limit",
        "64",
        "--max-stop-strings",
        "3",
        "--max-stop-string-chars",
        "9",
        "--max-logit-bias",
        "4",
        "--max-top-logprobs",
        "5",
        "--max-messages",
        "6",
        "--max-prompts",
        "7",
        "--max-queued-sequences",
        "8",
        "--max-request-tokens",
        "99",
        "--privileged-key",
        "alice",
    ]
    expected = ServerConfig(
        host="0.0.0.0",
        port=9001,
        served_model_names=("a", "b"),
        max_loaded_models=2,
        model_load_timeout_s=12.5,
        api_keys=(("alice", "sk-a"), ("carol", "-starts-with-a-dash")),
        admin_keys=(("ops", "sk-ops"), ("root", "sk-root")),
        prefix_cache_scope="global",
        rate_limits=(
            ("*", RateLimit(requests_per_minute=7, tokens_per_minute=900)),
            ("alice", RateLimit(requests_per_minute=5, tokens_per_minute=900)),
        ),
        public_metrics=True,
        access_log=False,
        log_level="debug",
        shutdown_timeout_s=3.0,
        tool_call_parser="hermes",
        reasoning_parser="qwen3",
        max_queued_requests=5,
        max_body_bytes=1000,
        max_n=2,
        max_tokens_limit=64,
        max_stored_responses=10,
        max_stop_strings=3,
        max_stop_string_chars=9,
        max_logit_bias=4,
        max_top_logprobs=5,
        max_messages=6,
        max_prompts=7,
        max_queued_sequences=8,
        max_request_tokens=99,
        privileged_keys=("alice",),
    )
    return flags, expected


def test_flags_to_server_config(tmp_path) -> None:
    flags, expected = _every_server_flag(tmp_path)
    args = ServerArgs.from_cli_args(build_parser().parse_args(["serve", *flags]))
    assert {f.name for f in fields(ServerArgs) if getattr(args, f.name) == f.default} == set()
    assert args.create_server_config(("a", "b")) == expected


def test_the_rendered_command_line_reads_back_to_the_same_settings(tmp_path) -> None:
    flags, _ = _every_server_flag(tmp_path)
    engine_flags = [
        "--max-model-len",
        "512",
        "--no-prefix-caching",
        "--kv-cache-memory",
        "64MiB",
        "--speculative-config",
        '{"method": "ngram"}',
        "--deterministic",
    ]
    given = build_parser().parse_args(["serve", "m", *flags, *engine_flags])
    server, engine = ServerArgs.from_cli_args(given), EngineArgs.from_cli_args(given, model="m")
    argv = server.as_argv() + engine.as_argv("serve", exclude=("model",))
    again = build_parser().parse_args(["serve", "m", *argv])
    assert ServerArgs.from_cli_args(again) == server
    assert EngineArgs.from_cli_args(again, model="m") == engine
    assert ServerArgs().as_argv() == [] and EngineArgs().as_argv("memory") == []


@pytest.mark.parametrize("command", [["serve", "m", "--replicas", "2"], ["cluster", "up", "m"]])
def test_a_replicas_command_line_round_trips_through_the_serve_parser(command: list[str], tmp_path) -> None:
    """What the cluster passes on is what was given, less the settings it makes per replica
    (address, threads, shutdown), plus the admin key it reads /metrics with."""
    flags, _ = _every_server_flag(tmp_path)
    given = build_parser().parse_args([*command, *flags, "--max-model-len", "512"])
    config = cluster_config(given)
    replica = build_parser().parse_args(["serve", "m", *config.replica.serve_args])
    own = {"host", "port", "shutdown_timeout"}
    expected = replace(ServerArgs.from_cli_args(given), **{n: getattr(ServerArgs(), n) for n in own})
    cluster_key = f"fornax-cluster:{config.replica.metrics_key}"
    expected = replace(expected, admin_key=(*(expected.admin_key or ()), cluster_key))
    assert ServerArgs.from_cli_args(replica) == expected
    assert EngineArgs.from_cli_args(replica, model="m").max_model_len == 512


def test_the_cli_tells_a_users_mistake_in_one_line_and_keeps_a_bugs_traceback(monkeypatch, capsys) -> None:
    import fornax.cli
    from fornax.engine.request import RequestRejected

    def rejected(args):
        raise RequestRejected("the prompt has 9000 tokens, but the maximum context length is 8192 tokens")

    def bug(args):
        raise ValueError("an internal invariant broke")

    for handler, raises in ((rejected, False), (bug, True)):
        monkeypatch.setattr(fornax.cli, "handler", lambda command, h=handler: h)
        if raises:
            with pytest.raises(ValueError, match="invariant"):
                fornax.cli.main(["pull"])
        else:
            assert fornax.cli.main(["pull"]) == 1
            assert (
                capsys.readouterr().err == "fornax: error: the prompt has 9000 tokens, but the maximum "
                "context length is 8192 tokens\n"
            )


@pytest.mark.parametrize("command", [["generate", "hi"], ["chat"]])
def test_the_terminal_commands_sample_as_sampling_params_but_for_their_declared_two(
    command: list[str],
) -> None:
    from fornax.cli import TERMINAL_SAMPLING, _sampling
    from fornax.engine.request import SamplingParams

    assert set(TERMINAL_SAMPLING) == {"max_tokens", "temperature"}  # a whole reply, greedy
    made = _sampling(build_parser().parse_args(command))
    assert made == SamplingParams(**TERMINAL_SAMPLING)


def test_the_parser_flags_name_the_parsers_there_are() -> None:
    from fornax.server_args import REASONING_PARSERS, TOOL_CALL_PARSERS
    from fornax.tools import PARSERS
    from fornax.tools.reasoning import REASONING_FORMATS

    assert set(REASONING_PARSERS) == {"auto", "none", *REASONING_FORMATS}
    assert set(TOOL_CALL_PARSERS) - {"auto"} <= set(PARSERS)
