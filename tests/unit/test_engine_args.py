"""EngineArgs is the one source of engine settings: every field is a flag of each command that
runs an engine and a keyword of LLM, with the same defaults, and flags, keywords and a config
built by hand all come to the same EngineConfig."""

from __future__ import annotations

import argparse
import ast
from dataclasses import fields
from pathlib import Path

import pytest

from fornax.cli import build_parser
from fornax.cluster.cli import cluster_config
from fornax.config import (
    SERVE_MAX_NUM_BATCHED_TOKENS,
    CacheConfig,
    ConfigError,
    EngineConfig,
    OffloadConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from fornax.engine_args import COMMAND_OVERRIDES, EngineArgs
from fornax.server_args import serve_models

ROOT = Path(__file__).resolve().parents[2]

# Each command that runs an engine, the argv that runs it with nothing else given, and the
# fields it has no flag for: in generate and chat, --seed is the request's sampling seed.
COMMANDS = {
    "generate": (["generate", "hi"], {"seed"}),
    "chat": (["chat"], {"seed"}),
    "memory": (["memory"], set()),
    "serve": (["serve"], set()),
    "cluster up": (["cluster", "up"], set()),
}


def _subparser(argv: list[str]) -> argparse.ArgumentParser:
    """The parser of the command `argv` runs (`cluster up`: two words)."""
    parser = build_parser()
    for word in argv:
        subparsers = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subparsers or word not in subparsers[0].choices:
            break
        parser = subparsers[0].choices[word]
    return parser


def _engine_actions(argv: list[str]) -> dict[str, argparse.Action]:
    names = EngineArgs.names()
    return {a.dest: a for a in _subparser(argv)._actions if a.option_strings and a.dest in names}


def _command_of(name: str) -> str:
    return "serve" if name == "cluster up" else name  # `cluster up` takes serve's flags


@pytest.mark.parametrize("name", COMMANDS)
def test_every_field_is_a_flag_of_each_engine_command(name: str) -> None:
    argv, without = COMMANDS[name]
    assert set(_engine_actions(argv)) == EngineArgs.names() - without


@pytest.mark.parametrize("name", COMMANDS)
def test_flag_defaults_are_the_fields_defaults(name: str) -> None:
    argv, _ = COMMANDS[name]
    overrides = COMMAND_OVERRIDES.get(_command_of(name), {})
    defaults = {f.name: f.default for f in fields(EngineArgs)}
    for dest, action in _engine_actions(argv).items():
        expected = overrides.get(dest, {}).get("default", defaults[dest])
        assert action.default == expected, dest


def test_the_only_command_override_is_the_servers_token_budget_and_its_models() -> None:
    assert {c: set(o) for c, o in COMMAND_OVERRIDES.items()} == {"serve": {"model", "max_num_batched_tokens"}}
    args = build_parser().parse_args(["serve"])
    assert args.max_num_batched_tokens == SERVE_MAX_NUM_BATCHED_TOKENS != EngineArgs().max_num_batched_tokens


def test_the_defaults_are_the_frozen_configs() -> None:
    assert EngineArgs().create_engine_config() == EngineConfig()
    assert EngineConfig().cache == CacheConfig() and EngineConfig().offload == OffloadConfig()


@pytest.mark.parametrize("name", COMMANDS)
def test_a_command_without_flags_runs_the_default_engine(name: str) -> None:
    argv, _ = COMMANDS[name]
    args = build_parser().parse_args(argv)
    expected = EngineConfig()
    if _command_of(name) == "serve":
        engine_args = EngineArgs.from_cli_args(args, model=serve_models(args)[0])
        expected = EngineConfig(
            scheduler=SchedulerConfig(max_num_batched_tokens=SERVE_MAX_NUM_BATCHED_TOKENS)
        )
    else:
        engine_args = EngineArgs.from_cli_args(args)
    assert engine_args.create_engine_config() == expected


# Every field away from its default, in two sets that each satisfy EngineConfig's checks (w8a8
# needs bfloat16 on the native kernels), as flags and the EngineConfig built by hand.
ROUND_TRIPS = [
    (
        [
            "--model",
            "some-model",
            "--quantization",
            "int4",
            "--small-step-max-rows",
            "3",
            "--large-step-quantization",
            "w8a8",
            "--large-step-min-rows",
            "8",
            "--lm-head-quantization",
            "int4",
            "--num-threads",
            "2",
            "--kv-cache-memory",
            "512MiB",
            "--kv-cache-dtype",
            "int8",
            "--max-num-seqs",
            "7",
            "--max-num-batched-tokens",
            "300",
            "--max-model-len",
            "1024",
            "--scheduling-policy",
            "priority",
            "--long-prefill-token-threshold",
            "64",
            "--block-size",
            "32",
            "--pooling",
            "mean",
            "--no-prefix-caching",
            "--kv-offload-memory",
            "1GiB",
            "--kv-offload-dir",
            "/tmp/kv",
            "--kv-offload-disk",
            "2GiB",
            "--kv-offload-dtype",
            "int8",
            "--preemption-mode",
            "recompute",
            "--speculative-config",
            '{"method": "ngram", "prompt_lookup_max": 3}',
            "--num-speculative-tokens",
            "2",
        ],
        EngineConfig(
            model="some-model",
            quantization="int4",
            small_step_max_rows=3,
            large_step_quantization="w8a8",
            large_step_min_rows=8,
            lm_head_quantization="int4",
            num_threads=2,
            cache=CacheConfig(
                block_size=32, kv_cache_memory=512 << 20, enable_prefix_caching=False, kv_cache_dtype="int8"
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=7,
                max_num_batched_tokens=300,
                max_model_len=1024,
                policy="priority",
                long_prefill_token_threshold=64,
            ),
            speculative=SpeculativeConfig(method="ngram", prompt_lookup_max=3, num_speculative_tokens=2),
            offload=OffloadConfig(
                host_memory=1 << 30,
                disk_dir="/tmp/kv",
                disk_bytes=2 << 30,
                dtype="int8",
                preemption_mode="recompute",
            ),
            pooling="mean",
        ),
    ),
    (
        [
            "--dtype",
            "float16",
            "--kernel-backend",
            "torch",
            "--num-blocks",
            "99",
            "--speculative-model",
            "draft-model",
        ],
        EngineConfig(
            dtype="float16",
            kernel_backend="torch",
            cache=CacheConfig(num_blocks=99),
            speculative=SpeculativeConfig(method="draft", model="draft-model"),
        ),
    ),
]


@pytest.mark.parametrize(("flags", "expected"), ROUND_TRIPS)
def test_flags_to_engine_args_to_engine_config(flags: list[str], expected: EngineConfig) -> None:
    from dataclasses import replace

    generate = build_parser().parse_args(["generate", "hi", *flags])
    assert EngineArgs.from_cli_args(generate).create_engine_config() == expected
    memory = build_parser().parse_args(["memory", "--seed", "9", *flags])
    assert EngineArgs.from_cli_args(memory).create_engine_config() == replace(expected, seed=9)
    serve = build_parser().parse_args(["serve", "--seed", "9", *flags])
    serve_args = EngineArgs.from_cli_args(serve, model=serve_models(serve)[0])
    if "--max-num-batched-tokens" not in flags:
        expected = replace(
            expected,
            scheduler=replace(expected.scheduler, max_num_batched_tokens=SERVE_MAX_NUM_BATCHED_TOKENS),
        )
    assert serve_args.create_engine_config() == replace(expected, seed=9)


@pytest.mark.parametrize(("flags", "expected"), ROUND_TRIPS)
def test_llm_keywords_build_the_same_engine_config(
    monkeypatch: pytest.MonkeyPatch, flags: list[str], expected: EngineConfig
) -> None:
    import fornax.llm

    built: list[EngineConfig] = []
    monkeypatch.setattr(fornax.llm, "build_engine_core", lambda config, progress: built.append(config))
    kwargs = EngineArgs.from_cli_args(build_parser().parse_args(["generate", "hi", *flags])).as_kwargs()
    fornax.llm.LLM(**kwargs, progress=False)
    fornax.llm.LLM()
    assert built == [expected, EngineConfig()]


def test_an_unknown_llm_keyword_is_a_type_error_naming_it() -> None:
    from fornax.llm import LLM

    with pytest.raises(TypeError, match=r"\['max_num_seq', 'prefix_caching'\]"):
        LLM(max_num_seq=8, prefix_caching=False, block_size=16)


def test_the_speculative_shorthands_need_a_method() -> None:
    with pytest.raises(ConfigError, match="--num-speculative-tokens needs"):
        EngineArgs(num_speculative_tokens=3).create_engine_config()
    assert EngineArgs(speculative_model="d").create_engine_config().speculative == SpeculativeConfig(
        method="draft", model="d"
    )


def test_cluster_replicas_get_the_engine_flags_given() -> None:
    """`cluster up` hands the engine flags given on to each replica's `fornax serve`, which
    then builds the engine the flags describe (--no-prefix-caching stores False)."""
    flags = [
        "--no-prefix-caching",
        "--long-prefill-token-threshold",
        "64",
        "--kv-offload-memory",
        "1GiB",
        "--max-num-batched-tokens",
        "2048",
    ]
    config = cluster_config(build_parser().parse_args(["cluster", "up", "m", *flags]))
    assert set(config.replica.serve_args) == {
        "--no-prefix-caching",
        "--long-prefill-token-threshold=64",
        "--kv-offload-memory=1GiB",
        "--max-num-batched-tokens=2048",
    }
    replica = build_parser().parse_args(["serve", "m", *config.replica.serve_args])
    direct = build_parser().parse_args(["serve", "m", *flags])
    assert EngineArgs.from_cli_args(replica, model="m") == EngineArgs.from_cli_args(direct, model="m")


def _engine_flag_spellings() -> set[str]:
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser, "memory")
    return {s for a in parser._actions if a.dest in EngineArgs.names() for s in a.option_strings}


# Flags spelled like an engine setting that mean something else where they are declared.
NOT_ENGINE_FLAGS = {
    ("fornax/cli.py", "--seed"): "generate and chat: the request's sampling seed",
    ("fornax/bench/cli.py", "--model"): "the model name the load test asks a server for",
    ("fornax/bench/cli.py", "--seed"): "the load test's workload seed",
}


def test_engine_flags_are_declared_only_in_engine_args() -> None:
    """No other module adds a flag of its own for an engine setting (a second declaration is
    where defaults drift apart), and LLM names no engine setting but its positional two."""
    spellings = _engine_flag_spellings()
    found = []
    for path in sorted((ROOT / "fornax").rglob("*.py")):
        if path.name == "engine_args.py":
            continue
        where = str(path.relative_to(ROOT))
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
                names = {
                    a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)
                }
                found += [
                    f"{where}:{node.lineno}: {s}"
                    for s in sorted(names & spellings)
                    if (where, s) not in NOT_ENGINE_FLAGS
                ]
    assert found == []
    init = next(
        n
        for n in ast.walk(ast.parse((ROOT / "fornax/llm.py").read_text()))
        if isinstance(n, ast.FunctionDef) and n.name == "__init__"
    )
    named = {a.arg for a in init.args.args + init.args.kwonlyargs} & EngineArgs.names()
    assert named == {"model", "dtype"}
