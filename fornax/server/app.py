"""The app factory, its lifespan (background model load, engine thread) and the uvicorn run
with a draining SIGTERM.

Shutdown order matters: on SIGTERM (or Ctrl-C) the server first drains — /health and new
requests get 503 while in-flight requests finish, for up to --shutdown-timeout, after which
the rest are aborted — and only then tells uvicorn to stop, so connections stay open while
their answers are being written. A second signal stops at once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager, suppress
from types import FrameType
from typing import TYPE_CHECKING, Any, TypeVar

import uvicorn
from fastapi import FastAPI

from fornax import __version__
from fornax.config import EngineConfig, ServedModelConfig, ServerConfig
from fornax.metrics.live import LiveStats
from fornax.metrics.prometheus import Metrics
from fornax.server import body_parser
from fornax.server.anthropic_messages import router as messages_router
from fornax.server.api import router
from fornax.server.auth import Gate, KeyStore
from fornax.server.embeddings import router as embeddings_router
from fornax.server.errors import install_error_handlers
from fornax.server.lora_routes import router as lora_router
from fornax.server.metrics_http import StatusCounter
from fornax.server.metrics_http import router as metrics_router
from fornax.server.model_set import ModelLeases, ModelSet, ServedModel
from fornax.server.openai_responses import router as responses_router
from fornax.server.openapi import install_openapi
from fornax.server.state import ServerState
from fornax.server.tenancy import log_tenancy
from fornax.server.visualizer import router as visualizer_router

if TYPE_CHECKING:
    from fornax.engine.async_engine import AsyncEngine

logger = logging.getLogger("fornax.server")
T = TypeVar("T")
# A dead engine's process answers /health 503 this long before exiting (or the shutdown
# timeout, if shorter): long enough for a probe or a router to see why it is going.
DEAD_ENGINE_GRACE_S = 2.0


def create_app(config: ServerConfig, models: EngineConfig | Sequence[ServedModelConfig]) -> FastAPI:
    """The server for one model (an EngineConfig, served as config.served_model_names) or
    several (each its ServedModelConfig: its names and engine; server/model_set.py)."""
    if isinstance(models, EngineConfig):
        models = [ServedModelConfig(config.served_model_names, models)]
    served = [
        ServedModel(m, Metrics(m.names[0], m.engine.scheduler.max_model_len), LiveStats()) for m in models
    ]
    model_set = ModelSet(served, config.max_loaded_models, config.model_load_timeout_s, config.retry_after_s)
    state = ServerState(config=config, models=model_set)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        model_set.set_loader(lambda model: _load_engine(app, state, model))
        # Loaded now unless loading is lazy (--max-loaded-models): then on first request.
        loader = None if model_set.lazy else asyncio.create_task(_load_all(app, state))
        try:
            yield
        finally:
            if loader is not None:
                loader.cancel()
            for model in model_set.models:
                if model.engine is not None:
                    model.engine.stop()
            if model_set.thread is not None:
                model_set.thread.stop()
            body_parser.shutdown()  # kills its worker process, if one was started: it may be stuck

    # /openapi.json describes the API (server/openapi.py); no docs pages: they load from a CDN.
    app = FastAPI(
        title="fornax",
        version=__version__,
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url="/openapi.json",
    )
    install_openapi(app, tuple(model_set.by_name))
    app.state.fornax = state
    app.state.exit_code = 0
    app.state.on_fatal = None  # set by serve(): how a failed load stops the process
    # HTTP statuses and the visualizer's default view: the first model's (a 401 names no model)
    app.state.metrics = model_set.primary.metrics
    app.state.live = model_set.primary.live
    install_error_handlers(app)
    app.include_router(router)
    app.include_router(messages_router)
    app.include_router(lora_router)
    app.include_router(responses_router)
    app.include_router(embeddings_router)
    app.include_router(metrics_router)
    app.include_router(visualizer_router)
    app.add_middleware(ModelLeases, models=model_set)
    app.add_middleware(Gate, state=state, keys=KeyStore(config.api_keys, config.admin_keys))
    app.add_middleware(
        StatusCounter, metrics=app.state.metrics
    )  # added last: outermost, sees the gate's answers
    return app


async def _load_all(app: FastAPI, state: ServerState) -> None:
    """Load every model at start-up, one after the other, off the event loop (so /health
    answers 503 meanwhile); one that fails stops the process with status 1."""
    for model in state.models.models:
        try:
            await state.models.start_load(model)
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.error("the model %s failed to load: %s", model.name, model.load_error)
            app.state.exit_code = 1
            if app.state.on_fatal is not None:
                app.state.on_fatal()
            return


async def _load_engine(app: FastAPI, state: ServerState, model: ServedModel) -> AsyncEngine:
    """Build `model`'s engine in a passing thread and start it on the shared engine thread."""
    from fornax.engine.async_engine import AsyncEngine, EngineThread

    start = time.monotonic()
    config = model.config.engine
    engine = await _in_passing_thread(AsyncEngine.from_config, config, False)
    engine.listeners.append(model.metrics.on_step)
    engine.listeners.append(model.live.on_step)
    loop = asyncio.get_running_loop()
    engine.on_dead = lambda exc: loop.call_soon_threadsafe(_engine_died, app, state, exc)
    if state.models.thread is None:
        state.models.thread = EngineThread()
    engine.start(loop, state.models.thread)
    logger.info(
        "model %s ready in %.1fs (context %d tokens); serving as %s",
        config.model,
        time.monotonic() - start,
        engine.max_model_len,
        ", ".join(model.config.names),
    )
    return engine


def _engine_died(app: FastAPI, state: ServerState, exc: BaseException) -> None:
    """In the event loop, once the engine loop has failed: every request was already failed
    and /health answers 503; exit non-zero so a supervisor (systemd, Kubernetes, Ray) starts
    a fresh process. uvicorn lets the error answers being written finish first."""
    grace = min(DEAD_ENGINE_GRACE_S, state.config.shutdown_timeout_s)
    logger.critical(
        "the engine has stopped (%s: %s): exiting with status 1 in %.1fs", type(exc).__name__, exc, grace
    )
    app.state.exit_code = 1
    if app.state.on_fatal is not None:
        asyncio.get_running_loop().call_later(grace, app.state.on_fatal)


async def _in_passing_thread(fn: Callable[..., T], *args: Any) -> T:
    """fn(*args) in a new thread that ends when fn returns, awaited without blocking the loop.

    Not asyncio.to_thread: its executor's threads live on, and loading runs OpenMP regions
    (torch's, and the native kernels' repacking). GNU OpenMP keeps a team of worker threads
    for every thread that has started a region, for as long as that thread lives; once it
    manages more threads than there are CPUs, its barriers stop spinning and sleep in the
    kernel. A loader's team left beside the engine thread's made every barrier of every step
    a futex sleep and wake: on 2 CPUs a one-row decode step took 11.9 ms instead of 2.5
    (119,480 context switches against 444 in `perf stat`) and a 32-row step 37 instead of 20.
    So the engine thread must be the only live thread that has run OpenMP work.
    """
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()

    def settle(result: Any, exc: BaseException | None) -> None:
        if done.done():  # the awaiting task was cancelled (shutdown during the load)
            return
        if exc is not None:
            done.set_exception(exc)
        else:
            done.set_result(result)

    def target() -> None:
        try:
            result, exc = fn(*args), None
        except BaseException as error:
            result, exc = None, error
        with suppress(RuntimeError):  # the loop closed while loading: nobody is waiting
            loop.call_soon_threadsafe(settle, result, exc)

    thread = threading.Thread(target=target, name="fornax-load", daemon=True)
    thread.start()
    result = await done
    thread.join()  # already returning: this only makes sure its OpenMP teams are gone
    return result


class DrainingServer(uvicorn.Server):
    """uvicorn, except that the first SIGTERM/SIGINT drains before uvicorn starts shutting down."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task[None] | None = None

    async def serve(self, sockets: list | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Deliberately not recording the signal: uvicorn would re-raise it after shutdown,
        # and the process would die of it instead of exiting 0 after a clean drain.
        if self.state.draining or self._loop is None or not self.state.models.loaded():
            self.should_exit = True
            if self.state.draining:
                self.force_exit = True
            return
        self.state.draining = True
        self._loop.call_soon_threadsafe(self._start_drain, signal.Signals(sig).name)

    def _start_drain(self, why: str) -> None:
        self._drain_task = asyncio.ensure_future(self._drain(why))

    async def _drain(self, why: str) -> None:
        state, timeout = self.state, self.state.config.shutdown_timeout_s
        logger.info("%s: draining %d request(s) for up to %.0fs", why, len(state.inflight), timeout)
        deadline = time.monotonic() + timeout
        # Polled, not an Event: `inflight` is a plain dict emptied by each request's own
        # `finally`, and a drain checked 20 times a second costs nothing.
        while state.inflight and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
        if state.inflight:
            logger.warning("shutdown timeout: aborting %d request(s)", len(state.inflight))
            for entry in list(state.inflight.values()):
                for engine_id in entry.engine_ids:
                    entry.engine.abort(engine_id)
            end = time.monotonic() + 5.0
            while state.inflight and time.monotonic() < end:  # noqa: ASYNC110
                await asyncio.sleep(0.05)
        self.should_exit = True


def serve(config: ServerConfig, models: EngineConfig | Sequence[ServedModelConfig]) -> int:
    """Run the server until it is stopped; the process exit code."""
    app = create_app(config, models)
    log_tenancy(config, logger)
    # Open connections get at most 5 s (or the shutdown timeout, if shorter) once uvicorn stops.
    # h11 and asyncio named, not uvicorn's "auto": httptools and uvloop are installed for the
    # router, and must not change the server's parser or event loop behind its back.
    uv_config = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_config=None,
        log_level=config.log_level,
        access_log=config.access_log,
        timeout_graceful_shutdown=min(5, config.shutdown_timeout_s),
        lifespan="on",
        http="h11",
        loop="asyncio",
    )
    server = DrainingServer(uv_config, app.state.fornax)

    def fatal() -> None:
        server.should_exit = True

    app.state.on_fatal = fatal
    server.run()
    code = int(app.state.exit_code)
    if code:
        # The engine died; its requests are answered and uvicorn has stopped. Leave at once:
        # a tensor-parallel engine whose worker was killed left gloo's threads in a state
        # that, once in a loaded run, aborted the interpreter's teardown (status -6, not 1),
        # and a supervisor must see this status to start a fresh process.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code
