"""Where the engine process's resident memory goes, by owner (docs/memory.md).

Each line of the breakdown is measured on its own, never computed as what is left over:
- the tensors the engine owns (each weight form, the KV pools, the host KV tier, the rotary
  tables), by the pages of their address ranges that are in RAM (mincore), so pools count
  only what requests have written;
- the tokenizer, as the growth of malloc's in-use bytes while it loaded;
- malloc's other in-use bytes (torch's CPU tensors of a step, oneDNN's scratch buffers,
  Python's larger objects) from glibc's own account (mallinfo2);
- Python's small-object arenas, from the interpreter's own statistics;
- code and data of the shared libraries (torch, Python, ...), from /proc/self/smaps.
What no probe explains (malloc's freed-but-kept memory, thread stacks) is shown as
"unattributed", RSS minus the rest: a test holds it under 10% of RSS, so a breakdown that
misses an owner fails it.
"""

from __future__ import annotations

import os
import re
import select
import signal
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from fornax.layers.embedding import FileEmbedding
from fornax.layers.linear import Linear
from fornax.layers.process_memory import file_rss, malloc_stats, process_rss, resident_bytes
from fornax.layers.rotary import RotaryEmbedding

if TYPE_CHECKING:
    from fornax.engine.runner.model_runner import ModelRunner

# A Linear's forms by class, as the breakdown names them: what each is and which steps use it.
FORM_NAMES = {
    "BlockInt4": "int4 blocks (small steps)",
    "Int4Grouped": "int4 groups, torch kernel (small steps)",
    "BlockInt8": "int8 blocks (small steps)",
    "Int8PerChannel": "int8 per channel, torch kernel (small steps)",
    "Int8Rotated": "w8a8 rotated int8 (large steps)",
}


@dataclass(frozen=True)
class MemoryLine:
    owner: str
    bytes: int


@dataclass(frozen=True)
class MemoryReport:
    rss: int
    lines: list[MemoryLine]

    @property
    def attributed(self) -> int:
        return sum(line.bytes for line in self.lines)

    @property
    def unattributed(self) -> int:
        return self.rss - self.attributed

    def as_dict(self) -> dict[str, object]:
        return {
            "rss_bytes": self.rss,
            "owners": {line.owner: line.bytes for line in self.lines},
            "unattributed_bytes": self.unattributed,
        }

    def table(self) -> str:
        mib = 1 << 20
        rows = [f"{'owner':<52} {'MiB':>9}"]
        rows += [f"{line.owner:<52} {line.bytes / mib:9.1f}" for line in self.lines]
        rows += [f"{'unattributed (malloc free lists, thread stacks)':<52} {self.unattributed / mib:9.1f}"]
        rows += [f"{'resident set (RSS)':<52} {self.rss / mib:9.1f}"]
        return "\n".join(rows)


def _span(t: torch.Tensor) -> tuple[int, int]:
    return t.data_ptr(), t.numel() * t.element_size()


def weight_tensors(model: nn.Module, prefix: str = "weights") -> list[tuple[str, torch.Tensor]]:
    """(owner, tensor) for every tensor a model's steps read: each Linear's dense weight and
    forms, the embedding table (dense, or its rows in the file map), norms and biases."""
    out: list[tuple[str, torch.Tensor]] = []
    linear_params: set[int] = set()
    for module in model.modules():
        if isinstance(module, Linear):
            if module.weight is not None:
                dtype = str(module.weight.dtype).removeprefix("torch.")
                out.append((f"{prefix}: dense {dtype}", module.weight))
                linear_params.add(id(module.weight))
            if module.bias is not None:
                out.append((f"{prefix}: norms and biases", module.bias))
                linear_params.add(id(module.bias))
            for form in (module.small, module.mid, module.large):
                name = FORM_NAMES.get(type(form).__name__)
                if name is None:  # DenseBf16 reads the Linear's own weight; None: no form
                    continue
                out += [(f"{prefix}: {name}", v) for v in vars(form).values() if isinstance(v, torch.Tensor)]
            if module.lora is not None:  # --max-loras slots of --max-lora-rank, float32 (layers/lora.py)
                out += [(f"{prefix}: LoRA adapter slots", t) for t in (module.lora.a, module.lora.b)]
        elif isinstance(module, FileEmbedding):
            continue  # file pages: counted from the mapping's own resident set (memory_report)
        elif isinstance(module, nn.Embedding):
            out.append((f"{prefix}: embedding table", module.weight))
            linear_params.add(id(module.weight))
    for param in model.parameters():
        if id(param) not in linear_params:
            out.append((f"{prefix}: norms and biases", param))
    return out


def engine_tensors(runner: ModelRunner, proposer: object | None) -> list[tuple[str, torch.Tensor]]:
    """The tensors an engine owns, by owner (first claim wins where two share memory): its
    runner's model, KV pools and host KV tier, and the speculative proposer's, if any."""
    model = runner.model
    out = weight_tensors(model)
    out += [
        ("rotary tables", b) for m in model.modules() if isinstance(m, RotaryEmbedding) for b in m.buffers()
    ]
    out += [("KV cache pools", t) for layer in runner.kv_cache.layers for t in layer.tensors()]
    if runner.kv_connector is not None:
        out += [("KV host tier", t) for t in runner.kv_connector.memory_tensors()]
    draft = getattr(proposer, "model", None)  # the draft-model proposers own a model and its KV
    if isinstance(draft, nn.Module):
        out += weight_tensors(draft, "draft model")
        draft_layers = proposer.kv_cache.layers
        out += [("draft model KV pools", t) for layer in draft_layers for t in layer.tensors()]
    return out


def _by_owner(tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, list[tuple[int, int]]]:
    seen: set[tuple[int, int]] = set()
    owners: dict[str, list[tuple[int, int]]] = {}
    for owner, t in tensors:
        span = _span(t)
        if span[1] == 0 or span in seen:
            continue
        seen.add(span)
        owners.setdefault(owner, []).append(span)
    return owners


# Owners whose tensors torch took from malloc, which its in-use count includes too.
MALLOC_OWNERS = ("rotary tables", "weights: LoRA adapter slots")
ARENA_STATS_TIMEOUT_S = 2.0
_ARENAS = re.compile(rb"^(\d+) arenas \* (\d+) bytes/arena", re.M)


def python_object_arenas() -> int | None:
    """Bytes in CPython's small-object arenas (sys._debugmallocstats). That function prints to
    the C stderr, so it runs in a forked child whose stderr is a pipe: the parent's own stderr
    (its logs) is never redirected. None where fork or the statistics are missing."""
    if not hasattr(sys, "_debugmallocstats") or not hasattr(os, "fork"):
        return None
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: a copy of this heap, its arenas as they are now
        try:
            os.dup2(write_end, 2)
            sys._debugmallocstats()
        finally:
            os._exit(0)
    os.close(write_end)
    chunks: list[bytes] = []
    deadline = time.monotonic() + ARENA_STATS_TIMEOUT_S
    with os.fdopen(read_end, "rb", buffering=0) as f:
        while (left := deadline - time.monotonic()) > 0 and select.select([f], [], [], left)[0]:
            if not (chunk := f.read(65536)):
                break
            chunks.append(chunk)
        else:  # a child stuck (a stdio lock held at the fork by another thread): give up on it
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return None
    os.waitpid(pid, 0)
    match = _ARENAS.search(b"".join(chunks))
    return int(match.group(1)) * int(match.group(2)) if match else None


def memory_report(
    tensors: Iterable[tuple[str, torch.Tensor]], tokenizer_bytes: int, model_files: set[str]
) -> MemoryReport:
    """The process's resident memory by owner: `tensors` (engine_tensors), what the tokenizer
    took as it loaded, and the rest measured here. The pages mapped from `model_files` (the GGUF
    the embedding rows are read from) belong to the weights, not to the libraries."""
    owners = _by_owner(tensors)
    lines = [MemoryLine(owner, resident_bytes(spans)) for owner, spans in owners.items()]
    lines.append(MemoryLine("tokenizer", tokenizer_bytes))
    stats = malloc_stats()
    if stats is not None:
        # The rotary tables and the LoRA slots come from malloc and are counted above already.
        # (Where transparent huge pages are off, hugepages.pack leaves the weights in malloc
        # too, and they are then counted twice: not handled.)
        claimed = sum(size for owner in MALLOC_OWNERS for _, size in owners.get(owner, []))
        in_use = max(0, stats.in_use - tokenizer_bytes - claimed)
        owner = "malloc in use: step tensors, oneDNN scratch, Python's large objects"
        lines.append(MemoryLine(owner, in_use))
    arenas = python_object_arenas()
    if arenas is not None:
        lines.append(MemoryLine("Python objects (small-object arenas)", arenas))
    files = file_rss()
    # mincore would report the page cache, not this process's share: smaps gives the latter.
    model_pages = sum(v for p, v in files.items() if p in model_files)
    if model_pages:
        lines.append(MemoryLine("weights: model file pages (embedding rows read in place)", model_pages))
    libraries = sum(v for p, v in files.items() if p not in model_files)
    lines.append(MemoryLine("shared libraries (code and data)", libraries))
    return MemoryReport(rss=process_rss(), lines=lines)
