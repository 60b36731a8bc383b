"""fornax against llama.cpp's server: the same GGUF, the same load, one server after the other.

What it measures: output tokens/s, TTFT p50 and TPOT p50 of `fornax serve` and `llama-server`
serving one GGUF file under the same streaming load, at each number of concurrent streams.
Each round starts each server fresh, alone on the machine, in alternating order (llama fornax,
fornax llama, ...); the table shows medians over the rounds.

The load (fornax's own benchmark client, fornax/bench, which speaks plain OpenAI HTTP):
streaming POST /v1/completions, prompts of 30-300 random common words (one token each, or
close, with the default model's vocabulary), 128 greedy output tokens with EOS ignored
(`ignore_eos`, which both servers honour); at c streams, c short warm-up requests, then 2c
requests, c at a time. Output tokens are counted from each stream's usage and checked against
128 and against the number of streamed text chunks.

llama.cpp: its server, quantizer and llama-bench are built once from the llama-cpp-python sdist
(PyPI, vendor/llama.cpp) into a cache outside the repository, at an instruction-set level
(--level; `FORNAX_ISA=<level>` is passed to fornax so that both sides use the same one; with
`native` fornax gets no cap). Build log: <cache>/build.log.

Models: the default model's GGUF (`fornax pull smollm2-135m-instruct`), or with `--model 1b` a
model with Llama-3.2-1B's shapes and random weights (built once with transformers, converted with
the sdist's convert_hf_to_gguf.py and quantized to Q4_K_M): speed only, no quality figure comes
from it. `--roof` adds the memory-bandwidth roof of one decode stream: measured read bandwidth /
weight bytes read per token.

The machine must be otherwise idle: before each level the script waits for other programs to
leave the CPUs (--wait-idle), and it measures a level again (--retries) when the CPU time of
programs other than itself and its servers came to more than 0.15 cores during it.

    .venv/bin/python benchmarks/vs_llama_cpp.py --build-only                  # build llama.cpp once
    .venv/bin/python benchmarks/vs_llama_cpp.py --streams 1,8,32 --rounds 3 --json vs.json
    .venv/bin/python benchmarks/vs_llama_cpp.py --model 1b --streams 1,8 --roof

The sdist's converter imports sentencepiece for Llama models: `--model 1b` needs
`.venv/bin/pip install sentencepiece` once (not a dependency of fornax).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

from _servers import (
    MAKE_RUN_FLAGS,
    ServerProcess,
    free_port,
)  # benchmarks/ is on sys.path when run as a script

REPO = Path(__file__).resolve().parent.parent
LLAMA_CPP_PYTHON_VERSION = "0.3.36"
CACHE_ROOT = Path.home() / ".cache" / "fornax-bench"
CPUS = os.cpu_count() or 2

# ---- llama.cpp build -------------------------------------------------------------------------------

BUILD_TARGETS = ["llama-server", "llama-quantize", "llama-bench"]
# No network at build time: no curl/openssl, no web UI download; static binaries.
COMMON_CMAKE = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DBUILD_SHARED_LIBS=OFF",
]
# ggml/CMakeLists.txt's x86 options, and those each level turns on (the others are set OFF).
X86_OPTIONS = [
    "AVX",
    "AVX2",
    "FMA",
    "F16C",
    "AVX512",
    "AVX512_VNNI",
    "AVX512_BF16",
    "AMX_TILE",
    "AMX_INT8",
    "AMX_BF16",
]
_AVX2 = ("AVX", "AVX2", "FMA", "F16C")
LEVEL_OPTIONS: dict[str, tuple[str, ...]] = {
    "avx2": _AVX2,
    "avx512": (*_AVX2, "AVX512"),
    "avx512-vnni": (*_AVX2, "AVX512", "AVX512_VNNI"),
    "avx512-bf16": (*_AVX2, "AVX512", "AVX512_VNNI", "AVX512_BF16"),
    "amx": tuple(X86_OPTIONS),
}
LEVELS = [*LEVEL_OPTIONS, "native"]


def level_cmake_flags(level: str) -> list[str]:
    if level == "native":
        return ["-DGGML_NATIVE=ON"]
    on = LEVEL_OPTIONS[level]
    return ["-DGGML_NATIVE=OFF", *(f"-DGGML_{o}={'ON' if o in on else 'OFF'}" for o in X86_OPTIONS)]


def fetch_sdist(dest: Path) -> tuple[Path, str]:
    """Download and unpack the llama-cpp-python sdist (the pinned version, else the newest);
    returns its vendor/llama.cpp directory and the version."""
    dest.mkdir(parents=True, exist_ok=True)
    pip = [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", "-d", str(dest)]
    for spec in (f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}", "llama-cpp-python"):
        if list(dest.glob("llama_cpp_python-*.tar.gz")):
            break
        done = subprocess.run([*pip, spec], capture_output=True, text=True)
        if done.returncode:
            print(f"pip download {spec} failed:\n{done.stderr[-1500:]}", file=sys.stderr)
    tarballs = sorted(dest.glob("llama_cpp_python-*.tar.gz"))
    if not tarballs:
        raise RuntimeError("could not download the llama-cpp-python sdist")
    tarball = tarballs[-1]
    version = tarball.name.removeprefix("llama_cpp_python-").removesuffix(".tar.gz")
    src = dest / tarball.name.removesuffix(".tar.gz")
    if not (src / "vendor" / "llama.cpp" / "CMakeLists.txt").exists():
        with tarfile.open(tarball) as tar:
            tar.extractall(dest, filter="data")
    return src / "vendor" / "llama.cpp", version


def git_head(repo: Path) -> str:
    done = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else "unknown"


def ensure_llama_build(cache: Path, level: str) -> dict[str, Any]:
    """Build llama-server, llama-quantize and llama-bench into `cache` unless done; the build's facts."""
    info_path = cache / "build-info.json"
    if info_path.exists():
        return json.loads(info_path.read_text())
    cache.mkdir(parents=True, exist_ok=True)
    llama_dir, version = fetch_sdist(cache / "src")
    build_dir, log_path = cache / "build", cache / "build.log"
    flags = [*COMMON_CMAKE, *level_cmake_flags(level)]
    configure = ["cmake", "-S", str(llama_dir), "-B", str(build_dir), *flags]
    build = ["cmake", "--build", str(build_dir), "-j", str(CPUS), "--target", *BUILD_TARGETS]
    print(f"building llama.cpp ({version}, {level}) in {cache}; log: {log_path}", file=sys.stderr)
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        for cmd in (configure, build):
            log.write("$ " + " ".join(cmd) + "\n")
            log.flush()
            if subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode:
                raise RuntimeError(f"llama.cpp build failed: see {log_path}")
    missing = [t for t in BUILD_TARGETS if not (build_dir / "bin" / t).exists()]
    if missing:
        raise RuntimeError(f"llama.cpp build made no {', '.join(missing)}: see {log_path}")
    info = {
        "llama_cpp_python_version": version,
        "llama_cpp_commit": git_head(llama_dir),
        "level": level,
        "cmake_flags": flags,
        "build_seconds": round(time.monotonic() - t0, 1),
        "build_jobs": CPUS,
        "bin_dir": str(build_dir / "bin"),
        "src_dir": str(llama_dir),
    }
    info_path.write_text(json.dumps(info, indent=2) + "\n")
    return info


# ---- models ----------------------------------------------------------------------------------------

# Llama-3.2-1B's shapes (its config.json), for the random-weight model.
LLAMA_1B_SHAPES: dict[str, Any] = {
    "hidden_size": 2048,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 8192,
    "vocab_size": 128256,
    "tie_word_embeddings": True,
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 8192,
    "hidden_act": "silu",
}
RANDOM_1B_SEED = 0


def default_gguf() -> Path:
    """The default model's GGUF, pulled into fornax's cache if it is not there yet."""
    from fornax.config import DEFAULT_MODEL
    from fornax.models.registry import resolve_model

    resolved = resolve_model(DEFAULT_MODEL)
    assert resolved.gguf_path is not None, f"{DEFAULT_MODEL} is not a GGUF"
    return resolved.gguf_path


def write_tokenizer(out_dir: Path, vocab_size: int) -> None:
    """The default model's tokenizer (from its GGUF, as transformers reads one), its BPE vocabulary
    extended to `vocab_size` with plain word tokens that decode to " tok<id>". No merge makes
    them, so encoding is unchanged (and llama.cpp's converter still recognises the pre-tokenizer),
    and every id the random model can emit decodes to text, as in a real vocabulary."""
    from transformers import AutoTokenizer

    gguf = default_gguf()
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(str(out_dir))
    path = out_dir / "tokenizer.json"
    doc = json.loads(path.read_text(encoding="utf-8"))
    vocab: dict[str, int] = doc["model"]["vocab"]
    used = set(vocab.values()) | {t["id"] for t in doc["added_tokens"]}
    for token_id in range(vocab_size):
        if token_id not in used:
            vocab["\u0120tok" + str(token_id)] = token_id  # \u0120 is the byte-level space
    path.write_text(json.dumps(doc, ensure_ascii=False), encoding="utf-8")


def write_random_1b(hf_dir: Path) -> None:
    """Random weights (seeded) in Llama-3.2-1B's shapes, saved as float16 safetensors."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**LLAMA_1B_SHAPES, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(RANDOM_1B_SEED)
    model = LlamaForCausalLM(config).to(torch.float16)
    model.save_pretrained(str(hf_dir), safe_serialization=True)
    del model


def ensure_random_1b(model_dir: Path, llama: dict[str, Any]) -> Path:
    """The random Llama-3.2-1B-shaped model as a Q4_K_M GGUF, built once into `model_dir`."""
    q4 = model_dir / "random-llama-3.2-1b-shapes.Q4_K_M.gguf"
    if q4.exists():
        return q4
    hf_dir, f16 = model_dir / "hf", model_dir / "random-llama-3.2-1b-shapes.f16.gguf"
    log_path = model_dir / "build.log"
    hf_dir.mkdir(parents=True, exist_ok=True)
    print(f"building the random 1B model in {model_dir}; log: {log_path}", file=sys.stderr)
    t0 = time.monotonic()
    if not (hf_dir / "model.safetensors").exists():
        write_tokenizer(hf_dir, LLAMA_1B_SHAPES["vocab_size"])
        write_random_1b(hf_dir)
    src = Path(llama["src_dir"])
    env = {**os.environ, "PYTHONPATH": str(src / "gguf-py")}
    convert = [
        sys.executable,
        str(src / "convert_hf_to_gguf.py"),
        str(hf_dir),
        "--outtype",
        "f16",
        "--outfile",
        str(f16),
    ]
    quantize = [
        str(Path(llama["bin_dir"]) / "llama-quantize"),
        str(f16),
        str(q4) + ".tmp",
        "Q4_K_M",
        str(CPUS),
    ]
    with open(log_path, "a") as log:
        for cmd, cmd_env in ((convert, env), (quantize, None)):
            log.write("$ " + " ".join(cmd) + "\n")
            log.flush()
            if subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=cmd_env).returncode:
                raise RuntimeError(f"building the random 1B model failed: see {log_path}")
    os.replace(str(q4) + ".tmp", q4)
    for bulky in (f16, hf_dir / "model.safetensors"):  # only the Q4_K_M file is served
        bulky.unlink(missing_ok=True)
    print(f"random 1B model built in {time.monotonic() - t0:.0f} s", file=sys.stderr)
    return q4


# ---- the memory-bandwidth roof ---------------------------------------------------------------------


def weight_bytes_per_token(gguf_path: Path) -> int:
    """Bytes of tensors one decode token reads: all of them, except a token-embedding table that
    is only gathered from (when the output matrix is a tensor of its own; tied, it is read)."""
    from gguf import GGUFReader

    sizes = {t.name: int(t.n_bytes) for t in GGUFReader(str(gguf_path)).tensors}
    if "output.weight" in sizes:
        sizes.pop("token_embd.weight", None)
    return sum(sizes.values())


def read_bandwidth(gib: float = 1.0, repeats: int = 5) -> float:
    """Bytes/s of a torch sum over a `gib` GiB float32 array (all cores), best of `repeats`."""
    import torch

    x = torch.ones(int(gib * (1 << 30)) // 4, dtype=torch.float32)
    x.sum()  # fault the pages in
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best


def measure_roof(gguf: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The roof of one decode stream, its bandwidth measured again where other programs took CPU."""
    for _ in range(args.retries + 1):
        wait_idle(args.wait_idle)
        watch = OtherWork()
        bandwidth = read_bandwidth()
        other = watch.cores()
        if other <= OTHER_WORK_CORES:
            break
    else:
        args.notes.append(f"read bandwidth: other programs used {other:.2f} cores while it was measured")
    weights = weight_bytes_per_token(gguf)
    return {
        "read_bytes_per_s": bandwidth,
        "weight_bytes_per_token": weights,
        "tok_s": bandwidth / weights,
        "other_cores": other,
    }


# ---- servers ---------------------------------------------------------------------------------------


def start_server(name: str, gguf: Path, args: argparse.Namespace, log_dir: Path, tag: str) -> ServerProcess:
    port = free_port()
    env = dict(os.environ)
    if name == "fornax":
        cmd = [
            sys.executable,
            "-m",
            "fornax.cli",
            "serve",
            str(gguf),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            *MAKE_RUN_FLAGS,
            "--max-num-seqs",
            "64",
            "--no-access-log",
            "--log-level",
            "warning",
        ]
        if args.level != "native":
            env["FORNAX_ISA"] = args.level
    else:
        llama_server = str(Path(args.llama_info["bin_dir"]) / "llama-server")
        threads = ["-t", str(args.threads), "-tb", str(args.threads)]
        cmd = [
            llama_server,
            "-m",
            str(gguf),
            "-np",
            "32",
            "-c",
            "16384",
            *threads,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ]
    server = ServerProcess(name, cmd, port, log_dir / f"{name}-{tag}.log", env)
    try:
        server.wait_ready(timeout_s=args.ready_timeout)
    except BaseException:
        server.stop()
        raise
    return server


# ---- the load --------------------------------------------------------------------------------------

OUTPUT_TOKENS = 128
WARMUP_TOKENS = 16
PROMPT_WORDS = (30, 300)


def prompts(seed: int, n: int, output_len: int) -> list[Any]:
    import numpy as np

    from fornax.bench.workloads import BenchRequest, random_text

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        words = int(rng.integers(PROMPT_WORDS[0], PROMPT_WORDS[1] + 1))
        out.append(BenchRequest(random_text(rng, words, 1.0), words, output_len, ignore_eos=True))
    return out


async def measure_level(
    url: str, streams: int, seed: int, timeout_s: float, attempt: int = 0
) -> dict[str, Any]:
    """Warm up with `streams` short requests, then time 2x`streams` requests, `streams` at a time.

    A level measured again on the same server (`attempt` > 0) gets prompts of its own: the
    earlier attempt's would be prefix-cache hits on both servers and time no prefill."""
    import numpy as np

    from fornax.bench.client import Target, fetch_first_model, run_load
    from fornax.bench.report import summarize

    model = await fetch_first_model(url, None) or "model"
    target = Target(url, model, endpoint="completions", temperature=0.0)
    seed = seed * 1000 + attempt * 100_000
    warm = prompts(seed + streams, streams, WARMUP_TOKENS)
    results, _ = await run_load(target, warm, np.zeros(len(warm)), streams, timeout_s)
    if not all(r.success for r in results):
        raise RuntimeError(f"warm-up failed: {next(r.error for r in results if not r.success)}")
    reqs = prompts(seed + 500 + streams, 2 * streams, OUTPUT_TOKENS)
    results, duration = await run_load(target, reqs, np.zeros(len(reqs)), streams, timeout_s)
    s = summarize(results, duration)
    ok = [r for r in results if r.success]
    return {
        "streams": streams,
        "completed": s.completed,
        "failed": s.failed,
        "errors": sorted({r.error for r in results if r.error}),
        "duration_s": duration,
        "output_tokens": s.total_output_tokens,
        "output_tok_s": s.output_throughput,
        "ttft_p50_ms": s.ttft_ms.median,
        "tpot_p50_ms": s.tpot_ms.median,
        "itl_p50_ms": s.itl_ms.median,
        "e2el_p50_ms": s.e2el_ms.median,
        "usage_reported": all(r.usage_reported for r in ok),
        "output_tokens_per_request": sorted({r.output_tokens for r in ok}),
        "chunks_per_request": sorted({r.num_chunks for r in ok}),
        "mean_prompt_tokens": statistics.fmean(r.prompt_tokens for r in ok) if ok else None,
    }


def check_counts(name: str, m: dict[str, Any]) -> list[str]:
    """Warnings where a level's token counts are not the 128 per request asked for. Text chunks may
    fall a little short of the tokens (a token with no text of its own, such as a special token or
    part of a UTF-8 character, sends none), so only a gap of over 5% is flagged."""
    notes = []
    if m["failed"]:
        notes.append(f"{name} c={m['streams']}: {m['failed']} failed: {m['errors'][:2]}")
    if m["output_tokens_per_request"] != [OUTPUT_TOKENS]:
        notes.append(f"{name} c={m['streams']}: output tokens per request {m['output_tokens_per_request']}")
    if not m["usage_reported"]:
        notes.append(f"{name} c={m['streams']}: no usage in the stream; tokens counted as chunks")
    elif min(m["chunks_per_request"], default=0) < 0.95 * OUTPUT_TOKENS:
        notes.append(f"{name} c={m['streams']}: text chunks per request {m['chunks_per_request'][:8]}")
    return notes


def run_server(name: str, gguf: Path, args: argparse.Namespace, log_dir: Path, rnd: int) -> dict[int, Any]:
    """Start one server, measure every level on it (again, up to --retries times, where other
    programs took CPU time during it), stop it."""
    server = start_server(name, gguf, args, log_dir, f"r{rnd}")
    try:
        out = {}
        for c in args.streams:
            for attempt in range(args.retries + 1):
                if not wait_idle(args.wait_idle):
                    print(
                        f"  the machine is still busy after {args.wait_idle:g} s: measuring", file=sys.stderr
                    )
                watch = OtherWork()
                m = asyncio.run(measure_level(server.url, c, args.seed, args.request_timeout, attempt))
                m["other_cores"], m["attempts"] = watch.cores(), attempt + 1
                print(
                    f"  round {rnd} {name:6s} c={c:<3d} {m['output_tok_s']:8.1f} tok/s  "
                    f"TTFT p50 {m['ttft_p50_ms']:7.0f} ms  TPOT p50 {m['tpot_p50_ms']:6.1f} ms  "
                    f"other work {m['other_cores']:.2f} cores",
                    file=sys.stderr,
                )
                if m["other_cores"] <= OTHER_WORK_CORES:
                    break
            else:
                args.notes.append(
                    f"round {rnd} {name} c={c}: other programs used {m['other_cores']:.2f} cores"
                )
            out[c] = m
        return out
    finally:
        server.stop()


# ---- other work on the machine ---------------------------------------------------------------------

CLK_TCK = os.sysconf("SC_CLK_TCK")
OTHER_WORK_CORES = 0.15  # more CPU than this from other programs during a level, and it is measured again


def machine_cpu_s() -> float:
    """CPU seconds all cores have been busy since boot (/proc/stat: all but idle and iowait)."""
    ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return (sum(ticks) - ticks[3] - ticks[4]) / CLK_TCK


def tree_cpu_s(root: int) -> float:
    """CPU seconds of process `root` and every process under it, threads and reaped children included."""
    children: dict[int, list[int]] = {}
    ticks: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (comm)"
        except (OSError, IndexError):
            continue  # the process ended meanwhile
        pid = int(stat.parent.name)
        children.setdefault(int(fields[1]), []).append(pid)
        ticks[pid] = sum(int(x) for x in fields[11:15])  # utime stime cutime cstime
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        total += ticks.get(pid, 0)
        todo.extend(children.get(pid, []))
    return total / CLK_TCK


class OtherWork:
    """The CPU that programs other than this one and its servers use, from creation to `cores()`."""

    def __init__(self) -> None:
        self.t0, self.machine0, self.mine0 = time.monotonic(), machine_cpu_s(), tree_cpu_s(os.getpid())

    def cores(self) -> float:
        other = (machine_cpu_s() - self.machine0) - (tree_cpu_s(os.getpid()) - self.mine0)
        return max(0.0, other / max(1e-3, time.monotonic() - self.t0))


def wait_idle(limit_s: float, sample_s: float = 5.0) -> bool:
    """Until two samples in a row see other programs below OTHER_WORK_CORES; False after `limit_s`."""
    deadline, quiet, said = time.monotonic() + limit_s, 0, False
    while quiet < 2:
        if time.monotonic() > deadline:
            return False
        watch = OtherWork()
        time.sleep(sample_s)
        busy = watch.cores()
        quiet = quiet + 1 if busy <= OTHER_WORK_CORES else 0
        if not quiet and not said:
            print(f"  waiting for the machine: other programs use {busy:.2f} cores", file=sys.stderr)
            said = True
    return True


# ---- the report ------------------------------------------------------------------------------------


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def isa_flags() -> str:
    """`grep -o -w -E 'avx512[a-z_]*|amx[a-z_]*|avx2' /proc/cpuinfo | sort -u`, on one line."""
    text = Path("/proc/cpuinfo").read_text()
    return " ".join(sorted(set(re.findall(r"\b(?:avx512[a-z_]*|amx[a-z_]*|avx2)\b", text))))


def median_of(rounds: list[dict[str, Any]], name: str, c: int, key: str) -> float:
    return statistics.median(r[name][c][key] for r in rounds)


def format_table(rounds: list[dict[str, Any]], streams: list[int]) -> str:
    lines = [
        "| streams | llama-server tok/s | fornax tok/s | fornax / llama | TTFT p50 ms llama / fornax "
        "| TPOT p50 ms llama / fornax |",
        "| ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for c in streams:
        llama, fornax = (median_of(rounds, n, c, "output_tok_s") for n in ("llama", "fornax"))
        ttft = [median_of(rounds, n, c, "ttft_p50_ms") for n in ("llama", "fornax")]
        tpot = [median_of(rounds, n, c, "tpot_p50_ms") for n in ("llama", "fornax")]
        lines.append(
            f"| {c} | {llama:.1f} | {fornax:.1f} | {fornax / llama:.2f}x | {ttft[0]:.0f} / {ttft[1]:.0f} "
            f"| {tpot[0]:.1f} / {tpot[1]:.1f} |"
        )
    return "\n".join(lines)


def parse_streams(text: str) -> list[int]:
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--streams takes integers like 1,8,32; got {text!r}") from None
    if not levels or min(levels) < 1 or max(levels) > 32:
        raise argparse.ArgumentTypeError("--streams levels must be 1..32 (llama-server runs 32 slots)")
    return levels


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model",
        default="default",
        help="'default' (the default model's GGUF), '1b' (random weights, Llama-3.2-1B's "
        "shapes, Q4_K_M) or a GGUF path",
    )
    p.add_argument(
        "--level",
        choices=LEVELS,
        default="avx2",
        help="instruction-set level of the llama.cpp build and FORNAX_ISA",
    )
    p.add_argument(
        "--llama-cache",
        type=Path,
        default=None,
        help=f"llama.cpp build directory (default {CACHE_ROOT}/llama.cpp-<version>-<level>)",
    )
    p.add_argument(
        "--streams", type=parse_streams, default=[1, 8, 32], help="concurrent streams, e.g. 1,8,32"
    )
    p.add_argument("--rounds", type=int, default=1, help="rounds per server; medians are shown")
    p.add_argument("--threads", type=int, default=CPUS, help="llama-server -t/-tb (fornax uses every CPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--roof", action="store_true", help="print the memory-bandwidth roof of one decode stream")
    p.add_argument(
        "--build-only", action="store_true", help="build llama.cpp (and the --model 1b GGUF) and stop"
    )
    p.add_argument(
        "--wait-idle",
        type=float,
        default=900.0,
        help="seconds to wait, before each level, for other programs to leave the CPUs",
    )
    p.add_argument(
        "--retries",
        type=int,
        default=2,
        help="times a level is measured again when other programs used CPU during it",
    )
    p.add_argument("--json", type=Path, default=None, help="write every round's figures here")
    p.add_argument(
        "--log-dir", type=Path, default=None, help="server logs (default: a fresh temporary directory)"
    )
    p.add_argument("--ready-timeout", type=float, default=900.0, help="seconds a server may take to start")
    p.add_argument("--request-timeout", type=float, default=1800.0, help="seconds a load level may take")
    args = p.parse_args()
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    sys.path.insert(0, str(REPO))  # fornax, when run from elsewhere

    cache = args.llama_cache or CACHE_ROOT / f"llama.cpp-{LLAMA_CPP_PYTHON_VERSION}-{args.level}"
    args.llama_info = llama = ensure_llama_build(cache, args.level)
    commit, sdist = llama["llama_cpp_commit"][:12], llama["llama_cpp_python_version"]
    llama_version = f"llama.cpp {commit} (llama-cpp-python {sdist} sdist)"
    print(
        f"{llama_version}, {args.level}, built in {llama['build_seconds']:.0f} s: {llama['bin_dir']}",
        file=sys.stderr,
    )
    if args.model == "default":
        gguf = default_gguf()
    elif args.model == "1b":
        gguf = ensure_random_1b(cache.parent / "random-llama-3.2-1b-shapes", llama)
    else:
        gguf = Path(args.model).expanduser().resolve()
        if not gguf.is_file():
            p.error(f"no GGUF file at {gguf}")
    if args.build_only:
        print(gguf)
        return 0

    log_dir = args.log_dir or Path(os.environ.get("TMPDIR", "/tmp")) / f"vs-llama-cpp-{os.getpid()}"
    log_dir.mkdir(parents=True, exist_ok=True)
    args.notes = []
    roof = measure_roof(gguf, args) if args.roof else None
    started = dt.datetime.now(dt.UTC)
    rounds: list[dict[str, Any]] = []
    for rnd in range(args.rounds):
        order = ["llama", "fornax"] if rnd % 2 == 0 else ["fornax", "llama"]
        rounds.append({name: run_server(name, gguf, args, log_dir, rnd) for name in order})

    notes = args.notes + [
        n
        for r in rounds
        for name in ("llama", "fornax")
        for c in args.streams
        for n in check_counts(name, r[name][c])
    ]
    print()
    print(f"fornax vs llama-server, {gguf.name}, {args.rounds} round(s), {started:%Y-%m-%d %H:%M} UTC")
    print(f"CPU: {cpu_model()} ({CPUS} CPUs); ISA flags: {isa_flags() or '(none of avx2/avx512/amx)'}")
    isa_env = args.level if args.level != "native" else "(unset)"
    print(f"{llama_version}, level {args.level}; fornax with FORNAX_ISA={isa_env}")
    print(
        f"load: /v1/completions, streamed, prompts of {PROMPT_WORDS[0]}-{PROMPT_WORDS[1]} random words, "
        f"{OUTPUT_TOKENS} greedy tokens ignoring EOS, 2 x streams requests after a warm-up"
    )
    print()
    print(format_table(rounds, args.streams))
    levels = [m for r in rounds for by_level in r.values() for m in by_level.values()]
    tokens = sorted({n for m in levels for n in m["output_tokens_per_request"]})
    chunks = [n for m in levels for n in m["chunks_per_request"]]
    print(
        f"\noutput tokens per request, from the servers' usage: {', '.join(map(str, tokens))}; "
        f"streamed text chunks per request: {min(chunks, default=0)}-{max(chunks, default=0)}"
    )
    if roof:
        print(
            f"\nmemory-bandwidth roof, one decode stream: {roof['tok_s']:.1f} tok/s "
            f"({roof['read_bytes_per_s'] / 1e9:.1f} GB/s read / {roof['weight_bytes_per_token'] / 1e6:.1f} MB "
            "of weights per token)"
        )
    if args.model == "1b":
        print("note: random weights: these figures are speed only; no quality figure comes from this model")
    for note in notes:
        print(f"warning: {note}")
    print(f"server logs: {log_dir}", file=sys.stderr)
    if args.json:
        doc = {
            "started_at": started.isoformat(timespec="seconds"),
            "cpu": cpu_model(),
            "isa_flags": isa_flags(),
            "cpus": CPUS,
            "llama_cpp": llama,
            "model": str(gguf),
            "level": args.level,
            "streams": args.streams,
            "roof": roof,
            "rounds": [{n: list(r[n].values()) for n in r} for r in rounds],
            "warnings": notes,
        }
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
