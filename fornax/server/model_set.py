"""The models one server serves: each with its own engine, all on one engine thread.

Requests name a model (`model` in the body: any of its served names); `ModelSet.lease`
finds its engine, loading it first when needed. Without a cap every model is loaded at
start-up. With `--max-loaded-models K` models load on their first request, and when K are
loaded the least recently used idle one (no request holding it) is unloaded to make room:
its engine leaves the engine thread and its KV pools and weights are freed. A request for
a model that is loading waits for that load, bounded by the load timeout; if every loaded
model is busy, the request is refused with 503 and Retry-After.

The engines take turns on one thread (engine/async_engine.py EngineThread): one step at a
time with all the CPU's threads, rather than a thread per engine, whose OpenMP teams would
oversubscribe the cores (measured: benchmarks/multi_model.py, docs/models.md).

A lease is held from the moment a handler takes the engine until its response has been
sent (the `ModelLeases` middleware releases it), so a model is never unloaded under a
request that is still tokenizing, generating or streaming.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from starlette.types import ASGIApp, Receive, Scope, Send

from fornax.config import ServedModelConfig
from fornax.metrics.live import LiveStats
from fornax.metrics.prometheus import Metrics
from fornax.server.errors import ApiError

if TYPE_CHECKING:
    from fornax.engine.async_engine import AsyncEngine, EngineThread

logger = logging.getLogger("fornax.server")


@dataclass(eq=False)
class ServedModel:
    config: ServedModelConfig
    metrics: Metrics  # its series, labelled model_name=<first name>
    live: LiveStats  # the visualizer's rolling window of its steps
    engine: AsyncEngine | None = None
    load_error: str | None = None
    loading: asyncio.Future[AsyncEngine] | None = None
    leases: int = 0  # requests holding the engine (ModelSet.lease until ModelLeases releases)
    last_used: float = field(default_factory=time.monotonic)
    # LoRA adapters loaded through /v1/load_lora_adapter (name -> path): a reload loads them again.
    runtime_adapters: dict[str, str] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.config.names[0]

    @property
    def idle(self) -> bool:
        return self.leases == 0 and (self.engine is None or self.engine.num_unfinished == 0)


Loader = Callable[[ServedModel], Awaitable["AsyncEngine"]]


class ModelSet:
    def __init__(
        self, models: list[ServedModel], max_loaded: int | None, load_timeout_s: float, retry_after_s: int
    ) -> None:
        self.models = models
        self.by_name = {name: m for m in models for name in m.config.names}
        # LoRA adapters by name -> the model they adapt (server/lora_routes.py keeps it current):
        # a request naming one runs on that model's engine with the adapter.
        self.adapters: dict[str, ServedModel] = {
            name: m for m in models if m.config.engine.lora for name, _ in m.config.engine.lora.adapters
        }
        self.max_loaded, self.load_timeout_s, self.retry_after_s = max_loaded, load_timeout_s, retry_after_s
        self.thread: EngineThread | None = None  # the shared engine thread, made by the first load
        self._load: Loader | None = None  # set by the app: builds and starts an engine
        self._room = asyncio.Lock()  # one eviction decision at a time

    @property
    def primary(self) -> ServedModel:
        return self.models[0]

    @property
    def lazy(self) -> bool:
        return self.max_loaded is not None

    def loaded(self) -> list[ServedModel]:
        return [m for m in self.models if m.engine is not None]

    def find(self, name: str | None) -> ServedModel:
        """The model a request names (None or "": the first; an adapter's name: the model it
        adapts); unknown names are a 404."""
        if not name:
            return self.primary
        model = self.by_name.get(name) or self.adapters.get(name)
        if model is None:
            served = ", ".join([*self.by_name, *self.adapters])
            raise ApiError(
                404,
                f"The model '{name}' does not exist; this server serves {served}",
                param="model",
                code="model_not_found",
            )
        return model

    def set_loader(self, load: Loader) -> None:
        self._load = load

    async def lease(self, model: ServedModel, scope_state: dict[str, Any]) -> AsyncEngine:
        """`model`'s engine, loaded if needed, held for this request until its response ends."""
        model.leases += 1  # first: while waiting for a load, the model is not idle
        scope_state.setdefault("model_leases", []).append(model)
        model.last_used = time.monotonic()
        if model.engine is not None:
            return model.engine
        if model.load_error is not None and not self.lazy:
            raise ApiError(503, f"the model failed to load: {model.load_error}", code="model_load_failed")
        if model.loading is None:
            await self._make_room(model)
            if model.engine is not None:  # loaded while this request waited for the room
                return model.engine
            if model.loading is None:
                self.start_load(model)
        try:
            return await asyncio.wait_for(asyncio.shield(model.loading), self.load_timeout_s)
        except TimeoutError:
            raise ApiError(
                503,
                f"the model '{model.name}' is still loading",
                code="model_loading",
                headers={"Retry-After": str(self.retry_after_s)},
            ) from None
        except ApiError:
            raise
        except Exception as exc:
            raise ApiError(
                503, f"the model '{model.name}' failed to load: {exc}", code="model_load_failed"
            ) from None

    async def _make_room(self, model: ServedModel) -> None:
        if self.max_loaded is None:
            return
        async with self._room:
            occupied = [
                m for m in self.models if (m.engine is not None or m.loading is not None) and m is not model
            ]
            if len(occupied) < self.max_loaded:
                return
            idle = sorted(
                (m for m in occupied if m.engine is not None and m.idle and m is not model),
                key=lambda m: m.last_used,
            )
            if not idle:
                raise ApiError(
                    503,
                    f"{len(occupied)} model(s) are loaded and busy (--max-loaded-models "
                    f"{self.max_loaded}); retry shortly",
                    code="models_busy",
                    headers={"Retry-After": str(self.retry_after_s)},
                )
            await self.unload(idle[0])

    def start_load(self, model: ServedModel) -> asyncio.Future[AsyncEngine]:
        """Begin loading `model` (its `loading` future, which every waiter awaits)."""
        model.loading = asyncio.ensure_future(self._load_model(model))
        return model.loading

    async def _load_model(self, model: ServedModel) -> AsyncEngine:
        assert self._load is not None
        start = time.monotonic()
        try:
            engine = await self._load(model)
        except BaseException as exc:
            model.load_error = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            model.loading = None
        model.engine, model.load_error = engine, None
        model.metrics.on_model_loaded(time.monotonic() - start)
        await self._restore_adapters(model, engine)
        return engine

    async def _restore_adapters(self, model: ServedModel, engine: AsyncEngine) -> None:
        """A (re)loaded engine's adapters as the server last left them: those unloaded at run
        time stay unloaded, those loaded at run time are loaded again."""
        lora = engine.core.lora
        if lora is None:
            return
        for name in lora.registry.names():
            if self.adapters.get(name) is model:
                model.metrics.on_adapter(name, loaded=True)
            else:
                lora.unload(name)
        for name, path in model.runtime_adapters.items():
            try:
                await asyncio.to_thread(lora.load, name, path)
                model.metrics.on_adapter(name, loaded=True)
            except ValueError as exc:  # the file changed since: the adapter is gone, said once
                logger.error("LoRA adapter %s could not be loaded again: %s", name, exc)
                self.adapters.pop(name, None)

    async def unload(self, model: ServedModel) -> None:
        """Stop `model`'s engine and drop it (its KV pools and weights go with it)."""
        engine, model.engine = model.engine, None
        if engine is None:
            return
        logger.info("unloading model %s (least recently used, idle)", model.name)
        await asyncio.to_thread(engine.stop)  # waits for a step of its own to end
        model.metrics.on_model_unloaded()
        del engine
        from fornax.layers.process_memory import release_free_heap

        release_free_heap()  # its tensors were freed above: give the pages back now

    def release(self, model: ServedModel) -> None:
        model.leases -= 1
        model.last_used = time.monotonic()


class ModelLeases:
    """ASGI middleware: after a response has been sent (a stream to its end), release the
    model leases its handler took (ModelSet.lease)."""

    def __init__(self, app: ASGIApp, models: ModelSet) -> None:
        self.app, self.models = app, models

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            await self.app(scope, receive, send)
        finally:
            for model in scope.get("state", {}).pop("model_leases", []):
                self.models.release(model)
