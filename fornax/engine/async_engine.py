"""asyncio facade over EngineCore: submit, `async for` outputs, abort.

The core runs in one dedicated thread that loops schedule -> execute -> update. Why a
thread and not the event loop or another process: a step is a few to a few hundred
milliseconds of torch work, which releases the GIL, so HTTP parsing, tokenization and
SSE writing go on in the event loop while the model computes; a process would add a
copy of every token across a pipe and a second copy of the tokenizer for little gain at
this size. All engine state is touched by the engine thread only: callers talk to it
through a command queue, and outputs come back via `call_soon_threadsafe`.

Several engines (a server with several models) share one such thread, `EngineThread`, which
steps them in turn: one engine computes at a time, with all the cores. Not a thread per
engine: every thread that has run OpenMP work keeps its own team of workers, and once there
are more of them than CPUs their barriers sleep instead of spinning, which made each step of
a lone engine several times slower here (see server/app.py `_in_passing_thread`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from fornax.config import EngineConfig
from fornax.engine.build import build_engine_core
from fornax.engine.core import EngineCore
from fornax.engine.outputs import EngineOutput
from fornax.engine.pooling import PoolingParams
from fornax.engine.request import RequestRejected, SamplingParams
from fornax.engine.structured.spec import StructuredOutputsParams
from fornax.layers.process_memory import release_free_heap

logger = logging.getLogger("fornax.engine")


@dataclass
class StepStats:
    """One engine step, for metrics and live views (read by listeners in the engine thread)."""

    time: float
    duration_s: float
    num_batched_tokens: int
    num_seqs: int
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_preemptions_total: int
    outputs: list[EngineOutput]


StepListener = Callable[[StepStats], None]


class EngineDeadError(RuntimeError):
    """The engine thread stopped on an unexpected error; no more requests can be served."""


class RequestFailedError(RuntimeError):
    """The engine ended this one request on an internal error; the engine itself serves on."""


class EngineThread:
    """The thread that runs the steps of one or more engines: it drains each engine's commands,
    then runs one step of the next engine with work (round robin), so engines with requests
    share the CPU step by step. An engine whose step fails dies alone; the others go on."""

    def __init__(self, name: str = "fornax-engine") -> None:
        self._engines: list[AsyncEngine] = []
        self._wake = threading.Event()
        self._engines_lock = threading.Lock()  # the list; never held across work
        # Held while engines' commands or a step run: detach() waits on it, so an engine is
        # never closed under a step of its own.
        self._work_lock = threading.Lock()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._started = False

    def attach(self, engine: AsyncEngine) -> None:
        with self._engines_lock:
            self._engines.append(engine)
        if not self._started:
            self._started = True
            self._thread.start()
        self.wake()

    def detach(self, engine: AsyncEngine) -> None:
        """Remove `engine`; returns once no step of it is running (at most one step's wait)."""
        with self._engines_lock:
            if engine in self._engines:
                self._engines.remove(engine)
        with self._work_lock:
            pass  # the iteration that may still hold it has ended

    def wake(self) -> None:
        self._wake.set()

    def stop(self, timeout: float = 10.0) -> bool:
        """Stop the thread; False if it is still in a step after `timeout` seconds."""
        self._stopping = True
        self._wake.set()
        if self._started:
            self._thread.join(timeout=timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        busy_since_trim, turn = False, 0
        while not self._stopping:
            with self._engines_lock:
                engines = [e for e in self._engines if e.dead_error is None]
            with self._work_lock:
                for engine in engines:
                    engine._guarded(engine._drain_commands)
                busy = [e for e in engines if e.dead_error is None and e.core.has_unfinished_requests()]
                if busy:
                    engine = busy[turn % len(busy)]
                    turn += 1
                    busy_since_trim = True
                    engine._guarded(engine._step)
                    continue
            if busy_since_trim:
                # Going idle: give back what malloc kept of the steps' freed tensors (prefill
                # activations, logits); glibc would hold it for the process's life. A few ms,
                # once per busy period (docs/memory.md).
                release_free_heap()
                busy_since_trim = False
                continue  # a request may have arrived meanwhile
            self._wake.wait(timeout=0.5)
            self._wake.clear()


class AsyncEngine:
    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.tokenizer = core.tokenizer
        self.model_config = core.model_config
        self.max_model_len = core.max_model_len
        self.kernels = core.kernels  # what runs on this CPU, in one line (layers/kernel_plan.py)
        self._commands: queue.SimpleQueue[tuple[str, Any, Future | None]] = queue.SimpleQueue()
        self._streams: dict[str, asyncio.Queue[EngineOutput | Exception]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: EngineThread | None = None
        self._own_thread = False
        self.dead_error: BaseException | None = None
        self.listeners: list[StepListener] = []
        self.last_stats: StepStats | None = None
        # Called once, in the engine thread, when the engine dies (the server turns /health
        # 503 and exits non-zero so a supervisor restarts it).
        self.on_dead: Callable[[BaseException], None] | None = None
        # Guards dead_error against _submit: a command is either run by the engine thread or
        # failed by it when it dies, never left waiting forever.
        self._submit_lock = threading.Lock()

    @classmethod
    def from_config(cls, config: EngineConfig, progress: bool = True) -> AsyncEngine:
        return cls(build_engine_core(config, progress=progress))

    # -- lifecycle --
    def start(
        self, loop: asyncio.AbstractEventLoop | None = None, thread: EngineThread | None = None
    ) -> None:
        """Run on `thread` (shared with other engines), or on a thread of its own."""
        self._loop = loop or asyncio.get_running_loop()
        self._own_thread = thread is None
        self._thread = EngineThread() if thread is None else thread
        self._thread.attach(self)

    def stop(self) -> None:
        """Leave the engine thread (stopping it, if it is this engine's own), then flush what
        must outlive the process (the KV disk tier's pending writes, EngineCore.close) unless
        the thread is stuck in a step."""
        if self._thread is not None:
            if self._own_thread and not self._thread.stop():
                logger.warning("the engine thread did not stop; KV disk tier writes are not flushed")
                return
            self._thread.detach(self)
        try:
            self.core.close()
        except Exception:
            logger.exception("flushing the engine's KV tiers failed")

    @property
    def num_unfinished(self) -> int:
        return len(self._streams)

    # -- requests --
    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | PoolingParams,
        priority: int = 0,
        cache_salt: str | None = None,
        lora: str | None = None,
    ) -> AsyncIterator[EngineOutput]:
        """Submit a request and yield its outputs; leaving the loop early aborts it.
        `cache_salt` isolates its prefix-cache hits, `lora` names its adapter (EngineCore.add_request). PoolingParams
        submit a pooling request: its one output is final and carries the vector (see `embed`)."""
        if self.dead_error is not None:
            raise EngineDeadError(str(self.dead_error))
        stream: asyncio.Queue[EngineOutput | Exception] = asyncio.Queue()
        self._streams[request_id] = stream
        done = Future()
        self._submit("add", (request_id, prompt_token_ids, params, priority, cache_salt, lora), done)
        try:
            await asyncio.wrap_future(done)  # raises the core's ValueError for bad input
        except BaseException as exc:
            self._streams.pop(request_id, None)
            if isinstance(exc, asyncio.CancelledError):
                # The caller left (a client disconnect) while the add was queued or running:
                # if it ran, nobody would read the request's outputs, so it must not go on.
                self.abort(request_id)
            raise
        remaining = params.n if isinstance(params, SamplingParams) else 1
        try:
            while remaining:
                item = await stream.get()
                if isinstance(item, Exception):
                    raise item
                if item.error is not None:
                    raise (
                        RequestRejected(item.error)
                        if item.invalid_request
                        else RequestFailedError(item.error)
                    )
                if item.finished:
                    remaining -= 1
                yield item
        finally:
            if self._streams.pop(request_id, None) is not None and remaining:
                self.abort(request_id)  # the consumer went away (client disconnect, cancel)

    async def embed(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: PoolingParams,
        priority: int = 0,
        cache_salt: str | None = None,
        lora: str | None = None,
    ) -> EngineOutput:
        """Submit a pooling (embedding) request and return its one output, finished, with
        `embedding` (the vector) and `num_prompt_tokens`. Raises as `generate` does: ValueError
        (RequestRejected, PoolingParamsError) for what the engine refuses, RequestFailedError,
        EngineDeadError; a cancelled caller aborts the request."""
        final: EngineOutput | None = None
        async for out in self.generate(request_id, prompt_token_ids, params, priority, cache_salt, lora):
            final = out
        if final is None or final.embedding is None:
            raise RequestFailedError(f"request {request_id} ended without a vector")
        return final

    def compile_grammar(self, params: StructuredOutputsParams) -> Any:
        """Compile (and cache) a request's grammar in the calling thread, so the engine thread
        finds it ready; raises StructuredOutputsError for a constraint that cannot be served."""
        return self.core.grammars.compile(params)

    def abort(self, request_id: str) -> None:
        self._submit("abort", request_id, None)

    async def call(self, fn: Callable[[EngineCore], Any]) -> Any:
        """Run `fn(core)` in the engine thread between steps (for reads that need consistency)."""
        done: Future = Future()
        self._submit("call", fn, done)
        return await asyncio.wrap_future(done)

    def _submit(self, kind: str, payload: Any, done: Future | None) -> None:
        with self._submit_lock:
            if self.dead_error is not None:
                if done is not None:
                    done.set_exception(EngineDeadError(str(self.dead_error)))
                return
            self._commands.put((kind, payload, done))
        if self._thread is not None:
            self._thread.wake()

    # -- in the engine thread --
    def _guarded(self, work: Callable[[], None]) -> None:
        try:
            work()
        except BaseException as exc:
            logger.critical("the engine loop failed and stopped; every request is failed", exc_info=exc)
            self._die(exc)

    def _step(self) -> None:
        start = time.monotonic()
        outputs = self.core.step()
        self._after_step(start, outputs)

    def _die(self, exc: BaseException) -> None:
        """Fail every stream and every queued command at once, then tell the owner."""
        error = EngineDeadError(f"engine stopped: {type(exc).__name__}: {exc}")
        with self._submit_lock:
            self.dead_error = exc
        while True:
            try:
                _, _, done = self._commands.get_nowait()
            except queue.Empty:
                break
            if done is not None and done.set_running_or_notify_cancel():
                done.set_exception(error)
        self._fail_all(error)
        if self.on_dead is not None:
            try:
                self.on_dead(exc)
            except Exception:
                logger.exception("the engine's on_dead callback failed")

    def _drain_commands(self) -> None:
        while True:
            try:
                kind, payload, done = self._commands.get_nowait()
            except queue.Empty:
                return
            # A caller whose task was cancelled has cancelled its future too (asyncio.wrap_future
            # passes cancellation on): skip its command. Otherwise the future is marked running,
            # so it can no longer be cancelled, and setting its result below cannot raise
            # InvalidStateError, which here, in the engine loop, would stop the engine.
            if done is not None and not done.set_running_or_notify_cancel():
                continue
            try:
                if kind == "add":
                    self.core.add_request(*payload)
                    result = None
                elif kind == "abort":
                    self.core.abort_request(payload)
                    result = None
                else:
                    result = payload(self.core)
            except Exception as exc:
                if done is not None:
                    done.set_exception(exc)
                continue
            if done is not None:
                done.set_result(result)

    def _after_step(self, start: float, outputs: list[EngineOutput]) -> None:
        duration_s = time.monotonic() - start
        engine = self.core.stats()
        stats = StepStats(
            time=time.time(),
            duration_s=duration_s,
            num_batched_tokens=engine.last_step_num_batched_tokens,
            num_seqs=engine.last_step_num_seqs,
            num_running=engine.num_running,
            num_waiting=engine.num_waiting,
            kv_cache_usage=engine.kv_cache_usage,
            num_preemptions_total=engine.num_preemptions_total,
            outputs=outputs,
        )
        self.last_stats = stats
        for listener in list(self.listeners):
            try:
                listener(stats)
            except Exception:
                logger.exception("step listener %r failed and was detached", listener)
                self.listeners.remove(listener)
        if outputs and self._loop is not None:
            self._loop.call_soon_threadsafe(self._dispatch, outputs)

    def _dispatch(self, outputs: list[EngineOutput]) -> None:
        """In the event loop: hand each output to its request's stream."""
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.put_nowait(out)

    def _fail_all(self, exc: Exception) -> None:
        if self._loop is None:
            return

        def fail() -> None:
            for stream in self._streams.values():
                stream.put_nowait(exc)

        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is waiting
            self._loop.call_soon_threadsafe(fail)
