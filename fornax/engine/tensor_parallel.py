"""Tensor parallelism, the engine half: the engine process is rank 0 of a torch.distributed
group (gloo) and runs the scheduler, the KV bookkeeping, sampling and its own slice of the model;
ranks 1..N-1 are worker processes that hold the other slices (models/sharding.py) and
their KV pools, and run every step in lockstep.

Per step, rank 0 broadcasts what a step is (token ids, positions, each sequence's start,
length and block table) as a few tensors behind a fixed-size header: no pickled Python objects.
Each worker builds the same attention metadata from them and runs its slice; the all-reduces
inside the layers pair the ranks' forwards. The LM head is replicated, so logits and sampling
stay in the engine process and nothing comes back per step.

Every collective of a step has the group's timeout: a worker that dies makes rank 0's next
broadcast or all-reduce fail (or time out), which the engine loop turns into failed requests,
/health 503 and an exit (docs/reliability.md), never a hang. Only the wait for the next
message's header has none (a second group): an idle engine sends nothing.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing as mp
import socket
import threading
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from fornax.config import ConfigError, EngineConfig
from fornax.engine.kv.offload.build import host_block_layout
from fornax.engine.kv.offload.connector import TransferPlan
from fornax.engine.kv.offload.host_pool import HostPool
from fornax.engine.spec_decode.self_draft import make_self_draft
from fornax.layers.attention import SeqSpan, build_attention_metadata
from fornax.layers.native import load_paged_attention
from fornax.layers.ops import layer_ops
from fornax.models import DTYPES, load_engine_model, read_model_config
from fornax.models.base import KVCache
from fornax.models.sharding import connect_gloo_groups, gloo_shard, plan_shards

logger = logging.getLogger("fornax.engine")

# header kinds: a forward; stop; a self-draft's forward; KV copies to and from the host tier
STEP, STOP, DRAFT_STEP, TRANSFER = 0, 1, 2, 3
HEADER = 4  # [kind, tokens, sequences, widest block table]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class TensorParallelExecutor:
    """Rank 0's side (an engine/executor.py Executor): the worker processes, the group, and the
    per-step broadcast."""

    runs_native_step = False  # its one C call would skip the layers' all-reduces

    # What a spawned worker process runs, when not run_worker (a test gives one that fails).
    worker_main: Callable[[EngineConfig, int, str], None] | None = None

    def __init__(self, config: EngineConfig) -> None:
        self.world = config.tensor_parallel_size
        try:  # before any worker starts: a size the heads cannot take would fail in every one
            model_config = read_model_config(config.model)
            plan_shards(model_config, self.world)
        except ValueError as exc:
            raise ConfigError(f"tensor_parallel_size {self.world}: {exc}") from None
        if config.deterministic and model_config.moe is not None:  # models/sharding.py shard_cuts
            raise ConfigError(
                "deterministic tensor parallelism does not split a mixture-of-experts model's experts yet"
            )
        init = config.distributed_init or f"tcp://127.0.0.1:{_free_port()}"
        ctx = mp.get_context("spawn")
        self.workers = []
        if config.distributed_init is None:  # workers on this machine; else `fornax worker` elsewhere
            for rank in range(1, self.world):
                proc = ctx.Process(
                    target=self.worker_main or run_worker,
                    args=(config, rank, init),
                    name=f"fornax-tp-{rank}",
                    daemon=True,
                )
                proc.start()
                self.workers.append(proc)
        # group: a step's collectives (with the timeout); waiting: only the next message's header
        self.group, self.waiting = self._connect(init, config.distributed_timeout)
        # rank 0's own bound on sending a header: a worker that is alive but stuck never takes it
        self.timeout = timedelta(seconds=config.distributed_timeout)
        self.shard = gloo_shard(self.group, 0, exact=config.deterministic)  # rank 0's slice is this process's
        self.draft_step_to_ranks = self.send_draft_step
        self.closed = False
        atexit.register(self.close)  # workers stop with the engine process (they are daemons too)

    def _connect(self, init: str, timeout_s: float) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
        """Meet the workers at `init`. A spawned worker that exits before it joins (an import
        or start-up failure) fails this at once rather than after the store's timeout."""
        result: dict[str, object] = {}

        def connect() -> None:
            try:
                result["groups"] = connect_gloo_groups(init, 0, self.world, timeout_s)
            except Exception as exc:  # handed to the waiting thread below
                result["error"] = exc

        thread = threading.Thread(target=connect, name="fornax-tp-connect", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(0.1)
            gone = [p for p in self.workers if p.exitcode is not None]
            if gone and thread.is_alive():  # the thread waits out its timeout on its own
                raise RuntimeError(
                    f"tensor parallel worker {gone[0].name} exited with code {gone[0].exitcode} "
                    "before joining the group"
                )
        if "error" in result:
            raise result["error"]
        return result["groups"]

    def share_sizes(self, num_blocks: int, host_slots: int) -> None:
        """Rank 0 sized the KV cache and the host tier (0: none); every rank allocates that many
        blocks and slots for its own heads, so one block table and one slot plan serve all. Sent
        on the group the workers wait on without a timeout, as a header is: a worker that loaded
        its slice first waits here for however long rank 0's start-up takes (its load, the KV
        sizing, a kernel build), which the step timeout does not bound; the send itself is."""
        sizes = torch.tensor([num_blocks, host_slots], dtype=torch.int64)
        self.waiting.broadcast(sizes, 0).wait(self.timeout)

    def send_transfers(self, plan: TransferPlan) -> None:
        """A step's host-tier copies (engine/kv/offload), which every rank makes on its own heads'
        blocks: saves (block -> slot), then loads (slot -> block), as rank 0's connector does."""
        if plan.disk_loads or plan.writes:
            raise RuntimeError("tensor parallelism has no disk tier: a plan with disk work reached it")
        saves = torch.tensor(plan.saves, dtype=torch.int64).view(-1, 2)
        loads = torch.tensor(plan.loads, dtype=torch.int64).view(-1, 2)
        self._send_header(TRANSFER, len(saves), len(loads), 0)
        for t in (saves, loads):
            if t.numel():
                self.group.broadcast(t, 0).wait()

    def _send_header(self, *header: int) -> None:
        """The next message's header, on the group the workers wait on without a timeout; the
        send itself is bounded here (it completes only when every worker takes it)."""
        self.waiting.broadcast(torch.tensor(header, dtype=torch.int64), 0).wait(self.timeout)

    def send_draft_step(self, input_ids: torch.Tensor, positions: torch.Tensor, spans: list[SeqSpan]) -> None:
        """As send_step, for a self-draft's forward (engine/spec_decode/self_draft.py): its layers are
        the first of every rank's slice, and its KV pools each rank's own."""
        self.send_step(input_ids, positions, spans, DRAFT_STEP)

    def send_step(
        self, input_ids: torch.Tensor, positions: torch.Tensor, spans: list[SeqSpan], kind: int = STEP
    ) -> None:
        """What the workers need to run this step's forward with rank 0."""
        width = max(len(s.block_ids) for s in spans)
        tables = torch.full((len(spans), width), -1, dtype=torch.int32)
        for i, s in enumerate(spans):
            tables[i, : len(s.block_ids)] = torch.tensor(s.block_ids, dtype=torch.int32)
        shape = torch.tensor([[s.start, s.num_new] for s in spans], dtype=torch.int64)
        self._send_header(kind, len(input_ids), len(spans), width)
        for t in (input_ids.to(torch.int64), positions.to(torch.int64), shape, tables):
            self.group.broadcast(t.contiguous(), 0).wait()

    def close(self) -> None:
        """Tell the workers to exit and wait for them (a no-op after the first call)."""
        if self.closed:
            return
        self.closed = True
        broken = False
        try:
            self._send_header(STOP, 0, 0, 0)
        except RuntimeError as exc:  # a worker already gone: nothing to tell it
            logger.warning("tensor parallel: stopping the workers: %s", exc)
            broken = True
        for proc in self.workers:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.terminate()
        # Stop gloo's threads and connections now, while the interpreter is whole: a server
        # whose worker had been killed once aborted in interpreter teardown, after this ran
        # ("terminate called without an active exception", status -6 instead of 1).
        for group in (self.group, self.waiting):
            try:
                group.abort() if broken else group.shutdown()
            except RuntimeError as exc:
                logger.warning("tensor parallel: closing the group: %s", exc)


def _receive_transfers(group: dist.ProcessGroup, num_saves: int, num_loads: int) -> list[torch.Tensor]:
    copies = [torch.empty(num_saves, 2, dtype=torch.int64), torch.empty(num_loads, 2, dtype=torch.int64)]
    for t in copies:
        if t.numel():
            group.broadcast(t, 0).wait()
    return copies


def _receive_step(
    group: dist.ProcessGroup, waiting: dist.ProcessGroup
) -> tuple[int, torch.Tensor, torch.Tensor, list[SeqSpan]] | None:
    """The next message: a (draft) step as (kind, ids, positions, spans); a transfer as
    (TRANSFER, saves, loads, []); None for stop. Its header comes on `waiting`, which has no
    timeout to speak of (an engine may sit idle for hours); the rest on `group`."""
    header = torch.empty(HEADER, dtype=torch.int64)
    waiting.broadcast(header, 0).wait()
    kind, tokens, seqs, width = (int(x) for x in header)
    if kind == STOP:
        return None
    if kind == TRANSFER:
        return (TRANSFER, *_receive_transfers(group, tokens, seqs), [])
    input_ids, positions = torch.empty(tokens, dtype=torch.int64), torch.empty(tokens, dtype=torch.int64)
    shape, tables = torch.empty(seqs, 2, dtype=torch.int64), torch.empty(seqs, width, dtype=torch.int32)
    for t in (input_ids, positions, shape, tables):
        group.broadcast(t, 0).wait()
    spans = []
    for (start, num_new), row in zip(shape.tolist(), tables.tolist()):
        spans.append(SeqSpan(start, num_new, [b for b in row if b >= 0]))
    return kind, input_ids, positions, spans


def run_worker(config: EngineConfig, rank: int, init_method: str) -> None:
    """A worker rank: its slice of the model and of the KV pools, then steps until told to stop.
    Also what `fornax worker` runs on another machine."""
    torch.set_num_threads(config.threads_per_process())
    group, waiting = connect_gloo_groups(
        init_method, rank, config.tensor_parallel_size, config.distributed_timeout
    )
    try:
        sizes = torch.empty(2, dtype=torch.int64)
        dtype = DTYPES[config.dtype]
        loaded = load_engine_model(
            config, progress=False, shard=gloo_shard(group, rank, exact=config.deterministic)
        )
        # rank 0 sizes the cache and host tier, every rank holds as many; on `waiting`, since rank
        # 0's start-up may outlast the step timeout (share_sizes)
        waiting.broadcast(sizes, 0).wait()
        num_blocks, host_slots = (int(x) for x in sizes)
        local = loaded.local_config or loaded.config
        cache = config.cache
        kv = KVCache(local, num_blocks, cache.block_size, dtype, cache.kv_cache_dtype)
        host = HostPool(host_block_layout(config, local), host_slots) if host_slots else None
        model = loaded.model
        kernel = load_paged_attention() if config.kernel_backend == "native" else None
        kernel = kernel if kernel is not None and kernel.supports(dtype) else None
        model.use_ops(layer_ops(config.kernel_backend, dtype))
        # A self-draft is built from this rank's slice as rank 0 builds its own (after use_ops,
        # as the engine does), with a KV pool of its own layers: DRAFT_STEP runs it.
        spec = config.speculative
        draft, draft_kv = None, None
        if spec is not None and spec.method == "self":
            draft = make_self_draft(model, spec.draft_layers, spec.quantization)
            draft_kv = KVCache(draft.config, num_blocks, cache.block_size, dtype)
        while (step := _receive_step(group, waiting)) is not None:
            kind, input_ids, positions, spans = step
            if kind == TRANSFER:  # input_ids, positions: the saves and loads
                assert host is not None, "host-tier copies without a host tier"
                saves, loads = input_ids.tolist(), positions.tolist()
                if saves:
                    host.save(kv.layers, [b for b, _ in saves], [slot for _, slot in saves])
                if loads:
                    host.load(kv.layers, [slot for slot, _ in loads], [b for _, b in loads])
                continue
            runs, pool = (draft, draft_kv) if kind == DRAFT_STEP else (model, kv)
            assert runs is not None and pool is not None, "a draft step without a self-draft"
            meta = build_attention_metadata(
                spans,
                cache.block_size,
                local.sliding_window,
                kernel,
                local.interleaves_sliding_window,
                # the draft proposer builds its metadata in the default mode (draft_model.py)
                deterministic=config.deterministic and kind != DRAFT_STEP,
            )
            with torch.inference_mode():
                runs(input_ids, positions, pool, meta)
    except RuntimeError as exc:  # rank 0 gone or a collective timed out: exit, do not linger
        logger.error("tensor parallel worker %d: %s", rank, exc)
        raise SystemExit(1) from exc
