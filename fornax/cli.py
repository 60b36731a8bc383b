"""`fornax pull | generate | chat` (and, as they land, serve and bench).

Errors a user can cause (a bad path, an unknown alias, a broken file, a bad parameter)
print one line to stderr and exit 1, never a traceback.
"""

from __future__ import annotations

import argparse
import sys
import time

from fornax.config import DEFAULT_MODEL, ConfigError


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "-m", default=DEFAULT_MODEL, help="GGUF file, HF directory or alias")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    p.add_argument("--kv-cache-memory", default="1GiB", help="KV cache budget, e.g. 512MiB")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fornax", description="LLM inference engine and server")
    sub = parser.add_subparsers(dest="command", required=True)
    pull = sub.add_parser("pull", help="fetch a model into the cache (FORNAX_HOME)")
    pull.add_argument("model", nargs="?", default=DEFAULT_MODEL)
    gen = sub.add_parser("generate", help="generate a completion for one prompt")
    gen.add_argument("prompt")
    gen.add_argument("--raw", action="store_true", help="no chat template: plain text completion")
    _add_model_args(gen)
    _add_sampling_args(gen)
    chat = sub.add_parser("chat", help="interactive chat in the terminal, streaming tokens")
    chat.add_argument("--system", default=None, help="system prompt")
    _add_model_args(chat)
    _add_sampling_args(chat)
    return parser


def _sampling(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from fornax.engine.request import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed
    )


def _llm(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from fornax.llm import LLM

    return LLM(args.model, dtype=args.dtype, kv_cache_memory=args.kv_cache_memory)


def cmd_pull(args: argparse.Namespace) -> None:
    from fornax.models.registry import resolve_model

    resolved = resolve_model(args.model)
    print(resolved.gguf_path or resolved.hf_dir)


def _stream(llm, prompt_ids: list[int], params) -> str:  # type: ignore[no-untyped-def]
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
        ids = tok.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True,
                                      tokenize=True)  # fmt: skip
    _stream(llm, ids, _sampling(args))


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


def main(argv: list[str] | None = None) -> int:
    from fornax.models.loader import ModelLoadError
    from fornax.models.registry import ModelSourceError

    args = build_parser().parse_args(argv)
    handlers = {"pull": cmd_pull, "generate": cmd_generate, "chat": cmd_chat}
    try:
        handlers[args.command](args)
    except (ModelSourceError, ModelLoadError, ConfigError, ValueError) as exc:
        print(f"fornax: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
