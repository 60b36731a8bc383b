"""`fornax pull | generate | chat | memory | serve | worker | bench serve | router | cluster up`.

Errors a user can cause (a bad path, an unknown alias, a broken file, a bad parameter)
print one line to stderr and exit 1, never a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from fornax.config import DEFAULT_MODEL, ConfigError, ServedModelConfig
from fornax.engine_args import EngineArgs
from fornax.server_args import ServerArgs, add_serve_args, serve_models, served_names

if TYPE_CHECKING:  # the model modules load torch: only when a command runs one
    from fornax.engine.request import SamplingParams
    from fornax.llm import LLM

# The engine flags of generate and chat, less --seed: there it is the request's (sampling) seed.
_SAMPLING_COMMAND_EXCLUDES = ("seed",)


# generate and chat answer a person at a terminal: a whole reply, and the model's most likely
# one. Every other sampling default is SamplingParams' own, which follow OpenAI's API (16
# tokens, temperature 1) as the server does.
TERMINAL_SAMPLING = {"max_tokens": 256, "temperature": 0.0}


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    from fornax.engine.request import SamplingParams  # no torch: the parser stays light

    default = {f.name: f.default for f in dataclasses.fields(SamplingParams)} | TERMINAL_SAMPLING
    p.add_argument("--max-tokens", type=int, default=default["max_tokens"])
    p.add_argument("--temperature", type=float, default=default["temperature"])
    p.add_argument("--top-p", type=float, default=default["top_p"])
    p.add_argument("--top-k", type=int, default=default["top_k"])
    p.add_argument(
        "--seed",
        dest="sampling_seed",
        metavar="SEED",
        type=int,
        default=default["seed"],
        help="the request's sampling seed",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fornax", description="LLM inference engine and server")
    sub = parser.add_subparsers(dest="command", required=True)
    pull = sub.add_parser("pull", help="fetch a model into the cache (FORNAX_HOME)")
    pull.add_argument("model", nargs="?", default=DEFAULT_MODEL)
    gen = sub.add_parser("generate", help="generate a completion for one prompt")
    gen.add_argument("prompt")
    gen.add_argument("--raw", action="store_true", help="no chat template: plain text completion")
    EngineArgs.add_cli_args(gen, "generate", exclude=_SAMPLING_COMMAND_EXCLUDES)
    _add_sampling_args(gen)
    chat = sub.add_parser("chat", help="interactive chat in the terminal, streaming tokens")
    chat.add_argument("--system", default=None, help="system prompt")
    EngineArgs.add_cli_args(chat, "chat", exclude=_SAMPLING_COMMAND_EXCLUDES)
    _add_sampling_args(chat)
    memory = sub.add_parser("memory", help="load a model as the flags say; print its memory by owner")
    memory.add_argument("--json", action="store_true", help="print the breakdown as JSON")
    EngineArgs.add_cli_args(memory, "memory")
    worker = sub.add_parser(
        "worker", help="one rank of a tensor-parallel engine started elsewhere (--distributed-init)"
    )
    worker.add_argument("--rank", type=int, required=True, help="this process's rank, 1 .. size - 1")
    EngineArgs.add_cli_args(worker, "worker")
    serve = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    add_serve_args(serve)
    from fornax.cluster.cli import add_cluster_parser, add_replicas_arg

    add_replicas_arg(serve)
    add_cluster_parser(sub)
    from fornax.bench.cli import add_bench_parser

    add_bench_parser(sub)
    from fornax.router.cli import add_router_parser

    add_router_parser(sub)
    return parser


def _sampling(args: argparse.Namespace) -> SamplingParams:
    from fornax.engine.request import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.sampling_seed,
    )


def _llm(args: argparse.Namespace) -> LLM:
    from fornax.llm import LLM

    return LLM(**EngineArgs.from_cli_args(args).as_kwargs())


def cmd_pull(args: argparse.Namespace) -> None:
    from fornax.models.registry import resolve_model

    resolved = resolve_model(args.model)
    print(resolved.gguf_path or resolved.hf_dir)


def _stream(llm: LLM, prompt_ids: list[int], params: SamplingParams) -> str:
    """Print tokens as they are produced; return the whole text."""
    text, start, n = "", time.perf_counter(), 0
    for out in llm.stream(prompt_ids, params):
        sys.stdout.write(out.new_text)
        sys.stdout.flush()
        text += out.new_text
        n += len(out.new_token_ids)
    elapsed = time.perf_counter() - start
    print(f"\n[{n} tokens, {n / elapsed:.1f} tok/s]", file=sys.stderr)
    return text


def cmd_generate(args: argparse.Namespace) -> None:
    llm = _llm(args)
    tok = llm.get_tokenizer()
    if args.raw or tok.chat_template is None:
        ids = tok.encode(args.prompt)
    else:
        ids = tok.apply_chat_template(
            [{"role": "user", "content": args.prompt}], add_generation_prompt=True, tokenize=True
        )
    _stream(llm, ids, _sampling(args))


def cmd_memory(args: argparse.Namespace) -> None:
    """The breakdown of engine/memory_report.py after loading and one short generation (so the lazily
    built state of the first steps is in it), as `fornax serve` would hold it at rest."""
    import json

    from fornax.engine.request import SamplingParams
    from fornax.layers.process_memory import release_free_heap

    llm = _llm(args)
    llm.generate(["What is LLM inference?"], SamplingParams(max_tokens=8, temperature=0.0))
    release_free_heap()  # what the server does when it goes idle
    report = llm.engine.memory_report()
    kernels = llm.engine.kernels
    if args.json:
        print(json.dumps({**report.as_dict(), "kernels": kernels}, indent=2))
    else:
        print(f"{kernels}\n{report.table()}")


def cmd_chat(args: argparse.Namespace) -> None:
    llm = _llm(args)
    tok = llm.get_tokenizer()
    messages = [{"role": "system", "content": args.system}] if args.system else []
    print("fornax chat: type a message, an empty line or Ctrl-D to quit.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        messages.append({"role": "user", "content": line})
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        reply = _stream(llm, ids, _sampling(args))
        messages.append({"role": "assistant", "content": reply})


def cmd_worker(args: argparse.Namespace) -> None:
    """Join the tensor-parallel group at --distributed-init as --rank, with the engine's flags
    (the same model, dtype, forms and --tensor-parallel-size as rank 0), until it stops."""
    from fornax.engine.tensor_parallel import run_worker

    config = EngineArgs.from_cli_args(args).create_engine_config()
    if config.distributed_init is None or config.tensor_parallel_size < 2:
        raise SystemExit(
            "fornax worker: give --distributed-init tcp://HOST:PORT and --tensor-parallel-size N >= 2"
        )
    if not 1 <= args.rank < config.tensor_parallel_size:
        raise SystemExit(f"fornax worker: --rank must be in 1 .. {config.tensor_parallel_size - 1}")
    run_worker(config, args.rank, config.distributed_init)


def cmd_serve(args: argparse.Namespace) -> int:
    import logging

    if args.replicas > 1 and len(serve_models(args)) > 1:
        raise ConfigError(
            "--replicas runs copies of one model; serve several models without it, or one cluster each"
        )
    if args.replicas > 1:  # N replicas on Ray behind the router (fornax/cluster)
        from fornax.cluster.cli import serve_replicas

        return serve_replicas(args)
    from fornax.server.app import serve

    models = serve_models(args)
    names = served_names(models, args.served_model_name)
    server_config = ServerArgs.from_cli_args(args).create_server_config(names[0])
    engine_config = EngineArgs.from_cli_args(args, model=models[0]).create_engine_config()
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # every model with the same engine flags; LoRA adapters (--lora) adapt the first
    served = [
        ServedModelConfig(
            n, dataclasses.replace(engine_config, model=m, lora=engine_config.lora if i == 0 else None)
        )
        for i, (m, n) in enumerate(zip(models, names))
    ]
    return serve(server_config, served)


# The errors a user can cause, by the module that declares each: a bad flag, an unknown or
# broken model, a bad sampling parameter, a prompt the engine refuses, a broken chat template.
# A ValueError of any other kind is a bug and keeps its traceback.
_USER_ERRORS = (
    ("fornax.models.registry", "ModelSourceError"),
    ("fornax.models.loader", "ModelLoadError"),
    ("fornax.gguf_file", "GGUFFormatError"),
    ("fornax.engine.request", "SamplingParamsError"),
    ("fornax.engine.request", "RequestRejected"),
    ("fornax.chat_template", "ChatTemplateError"),
    ("fornax.models.lora", "AdapterError"),
    ("fornax.bench", "BenchUsageError"),
)


def user_errors() -> tuple[type[Exception], ...]:
    """The exceptions told as one line instead of a traceback. Those of other modules are
    looked up only among modules already imported: a handler that raised one has imported
    it, and importing them here would load torch (seconds, and its memory) for commands
    that never touch a model (`router`, `bench`, `cluster`)."""
    errors: list[type[Exception]] = [ConfigError]
    for module, name in _USER_ERRORS:
        loaded = sys.modules.get(module)
        if loaded is not None and hasattr(loaded, name):
            errors.append(getattr(loaded, name))
    return tuple(errors)


# Commands whose handler lives in another module, imported only when the command runs.
_HANDLER_MODULES = {
    "bench": ("fornax.bench.cli", "run_bench"),
    "cluster": ("fornax.cluster.cli", "run_cluster"),
    "router": ("fornax.router.cli", "cmd_router"),
}


def handler(command: str) -> Callable[[argparse.Namespace], int | None]:
    if command in _HANDLER_MODULES:
        module, name = _HANDLER_MODULES[command]
        return getattr(importlib.import_module(module), name)
    commands = {
        "pull": cmd_pull,
        "generate": cmd_generate,
        "chat": cmd_chat,
        "serve": cmd_serve,
        "memory": cmd_memory,
        "worker": cmd_worker,
    }
    return commands[command]


def router_parser() -> argparse.ArgumentParser:
    """`fornax router ...` alone: the full parser imports every command's module (the
    bench's numpy among them), which a long-running router would carry for nothing."""
    from fornax.router.cli import add_router_parser

    parser = argparse.ArgumentParser(prog="fornax", description="LLM inference engine and server")
    add_router_parser(parser.add_subparsers(dest="command", required=True))
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = (router_parser() if argv[:1] == ["router"] else build_parser()).parse_args(argv)
    try:
        code = handler(args.command)(args)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        if not isinstance(exc, user_errors()):
            raise
        print(f"fornax: error: {exc}", file=sys.stderr)
        return 1
    return code if isinstance(code, int) else 0


if __name__ == "__main__":
    sys.exit(main())
