"""Request bodies -> their pydantic models, the big ones parsed in a worker process.

Why a process: json.loads and pydantic's model_validate are C code that holds the GIL for its
whole run, so from a worker thread they stop the event loop all the same (threads only take
turns between Python bytecodes, every 5 ms). For a 4 MiB completions body of 600k token ids
that was ~60 ms of json.loads and 25-270 ms of model_validate, and a concurrent /health waited
up to 205 ms (2026-12-04). A worker process holds its own GIL. What it sends back is shaped to
be cheap to rebuild here, in a thread, in pieces of a few milliseconds: lists of token ids as
array('q') (pickled plainly, 600k ints took 18 ms to unpickle, in one C call that holds the
GIL), other lists and dicts as separate pickles of about CHUNK_BYTES each. Only top-level
fields are split: one message with 100k content parts would still come back in one piece.

Why spawn, not fork: the server process runs torch, its OpenMP threads and the engine thread;
a forked child would inherit a copy of locks held by threads that do not exist in it. A
spawned worker is a fresh interpreter that imports this module and what it needs (json,
pydantic, protocol, limits, errors): not torch, not fastapi. Like any spawned process it
also imports the main module, as __mp_main__: `fornax serve` guards its own, and a script
that calls app.serve() must do so under `if __name__ == "__main__":`.

Bodies up to INLINE_MAX_BYTES are parsed in a thread, as before (see its comment).
"""

from __future__ import annotations

import asyncio
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import threading
from array import array
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import suppress
from itertools import chain
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

from pydantic import BaseModel

from fornax.server.errors import ApiError
from fornax.server.limits import decode_json_object, parse_model, read_body, reject_unimplemented
from fornax.server.protocol import ChatCompletionRequest, CompletionRequest

if TYPE_CHECKING:
    from fastapi import Request

M = TypeVar("M", bound=BaseModel)

# 256 KiB of token ids (39k) parse inline in ~3 ms of json.loads and ~12 ms of validation,
# each one hold of the GIL (2026-12-04): short enough, and no round trip to the worker.
INLINE_MAX_BYTES = 256 << 10
# Parsing 4 MiB takes well under a second; a worker still busy after this is stuck.
PARSE_TIMEOUT_S = 30.0
# Pickles of about this size load in at most 4.6 ms for the costliest shape measured (chat
# messages, each a pydantic model) and under 1 ms for strings or dict entries (2026-12-04).
CHUNK_BYTES = 64 << 10
# array.tolist() this many ids at a time: ~2 ms each (600k at once took 15-24 ms).
TOLIST_STEP = 1 << 16
_GENERATION = (ChatCompletionRequest, CompletionRequest)


# ---- what the worker sends back ------------------------------------------------------------------


class Failure(NamedTuple):
    """An ApiError as plain data (ApiError itself does not survive pickling: its __init__
    takes more than the message)."""

    status: int
    message: str
    param: str | None
    code: str | None


class IdList(NamedTuple):
    ids: array  # list[int]


class IdLists(NamedTuple):
    ids: array  # list[list[int]], flattened
    lengths: array


class Chunks(NamedTuple):
    """Any other list or dict, pickled in pieces (a dict's pieces are lists of items)."""

    is_dict: bool
    pieces: list[bytes]


class Packed(NamedTuple):
    model: BaseModel  # the validated model, its list and dict fields set to None
    fields: dict[str, IdList | IdLists | Chunks]


# ---- parsing -----------------------------------------------------------------------------------


async def parse_body(request: Request, model_cls: type[M], max_bytes: int) -> M:
    """The request's body, bounded by max_bytes, as a validated `model_cls` (ApiError 400/413
    otherwise; 503 if the worker process failed)."""
    return await parse_bytes(await read_body(request, max_bytes), model_cls)


async def parse_bytes(
    raw: bytes,
    model_cls: type[M],
    *,
    inline_max_bytes: int = INLINE_MAX_BYTES,
    timeout_s: float = PARSE_TIMEOUT_S,
) -> M:
    if len(raw) <= inline_max_bytes:
        return await asyncio.to_thread(parse_raw, raw, model_cls)
    outcome = await _in_worker(raw, model_cls, timeout_s)
    if isinstance(outcome, Failure):
        raise ApiError(outcome.status, outcome.message, param=outcome.param, code=outcome.code)
    return await asyncio.to_thread(unpack, outcome, model_cls)


def parse_raw(raw: bytes, model_cls: type[M]) -> M:
    """The whole parse, the same in either process: decode, refuse fields asking for what
    generation cannot do, validate. Raises ApiError."""
    body = decode_json_object(raw)
    if model_cls in _GENERATION:
        reject_unimplemented(body)
    return parse_model(model_cls, body)


def parse_packed(raw: bytes, model_cls: type[BaseModel]) -> Packed | Failure:
    """parse_raw in the worker process, its answer shaped for the trip back."""
    try:
        return pack(parse_raw(raw, model_cls))
    except ApiError as exc:
        return Failure(exc.status, exc.message, exc.param, exc.code)


# ---- packing (in the worker) and unpacking (in a thread of the server) -------------------------------


def pack(model: BaseModel) -> Packed:
    fields = {
        name: _pack_value(value)
        for name, value in model.__dict__.items()
        if name in model.model_fields_set and isinstance(value, (list, dict))
    }
    skeleton = model.model_copy(update=dict.fromkeys(fields)) if fields else model
    return Packed(skeleton, fields)


def _pack_value(value: list[Any] | dict[str, Any]) -> IdList | IdLists | Chunks:
    """Token ids (list[int], list[list[int]]) as arrays when they fit 64 bits; anything else,
    and ids that do not fit, as chunks."""
    if isinstance(value, list) and all(type(v) is int for v in value):
        with suppress(OverflowError):  # ids past 64 bits are validated ints too (refused later)
            return IdList(array("q", value))
    elif isinstance(value, list) and all(type(v) is list and all(type(i) is int for i in v) for v in value):
        with suppress(OverflowError):
            return IdLists(array("q", chain.from_iterable(value)), array("q", map(len, value)))
    return _chunks(value)


def _chunks(value: list[Any] | dict[str, Any]) -> Chunks:
    whole = pickle.dumps(value, pickle.HIGHEST_PROTOCOL)
    count = -(-len(whole) // CHUNK_BYTES)
    items = list(value.items()) if isinstance(value, dict) else value
    if count <= 1 or len(items) <= 1:
        return Chunks(isinstance(value, dict), [whole])
    step = -(-len(items) // count)
    pieces = [pickle.dumps(items[i : i + step], pickle.HIGHEST_PROTOCOL) for i in range(0, len(items), step)]
    return Chunks(isinstance(value, dict), pieces)


def unpack(packed: Packed, model_cls: type[M]) -> M:
    """The worker's model with its fields rebuilt: the same object parse_raw returns here."""
    assert type(packed.model) is model_cls, (type(packed.model), model_cls)
    values = {name: _unpack_value(value) for name, value in packed.fields.items()}
    return packed.model.model_copy(update=values) if values else packed.model


def _unpack_value(value: IdList | IdLists | Chunks) -> list[Any] | dict[str, Any]:
    if isinstance(value, IdList):
        return _to_list(value.ids)
    if isinstance(value, IdLists):
        flat, out, start = _to_list(value.ids), [], 0
        for n in value.lengths:  # a Python loop: other threads (the event loop) get their turns
            out.append(flat[start : start + n])
            start += n
        return out
    if value.is_dict:
        mapping: dict[str, Any] = {}
        for piece in value.pieces:
            mapping.update(pickle.loads(piece))
        return mapping
    items: list[Any] = []
    for piece in value.pieces:
        items += pickle.loads(piece)
    return items


def _to_list(ids: array) -> list[int]:
    out: list[int] = []
    for start in range(0, len(ids), TOLIST_STEP):
        out += ids[start : start + TOLIST_STEP].tolist()
    return out


# ---- the worker process ----------------------------------------------------------------------------

_lock = threading.Lock()  # _executor is replaced from the event loop and from submitting threads
_executor: ProcessPoolExecutor | None = None


async def _in_worker(raw: bytes, model_cls: type[BaseModel], timeout_s: float) -> Packed | Failure:
    pool: ProcessPoolExecutor | None = None
    try:
        # Submitted from a thread: the first submit spawns the worker (a fork_exec of this big
        # process, and the pickling of the worker's start-up data).
        pool, future = await asyncio.to_thread(_submit, raw, model_cls)
        return await asyncio.wait_for(asyncio.wrap_future(future), timeout_s)
    except BrokenProcessPool:
        _replace(pool)
        raise ApiError(
            503,
            "the process parsing request bodies stopped while parsing this one; the "
            "request was not run, retry it",
            code="service_unavailable",
            headers={"Retry-After": "1"},
        ) from None
    except TimeoutError:
        _replace(pool)
        raise ApiError(
            503,
            f"parsing the request body took longer than {timeout_s:g} s; the request was not run",
            code="service_unavailable",
            headers={"Retry-After": "1"},
        ) from None


def _submit(raw: bytes, model_cls: type[BaseModel]) -> tuple[ProcessPoolExecutor, Future[Packed | Failure]]:
    """Queue one parse: (the pool, the parse's future)."""
    pool = _pool()
    try:
        return pool, pool.submit(parse_packed, raw, model_cls)
    except RuntimeError:  # broken (its worker died while idle) or just replaced: nothing was lost
        _replace(pool)
        pool = _pool()
        return pool, pool.submit(parse_packed, raw, model_cls)


def _pool() -> ProcessPoolExecutor:
    global _executor
    with _lock:
        if _executor is None:
            _executor = ProcessPoolExecutor(
                max_workers=1, mp_context=multiprocessing.get_context("spawn"), initializer=_init_worker
            )
        return _executor


def _init_worker() -> None:
    """In the worker. Ctrl-C reaches the whole process group (and systemd's SIGTERM the whole
    cgroup) while the server drains: the worker goes on parsing until the server stops it.
    And it leaves with the server, however the server ends: an idle worker never sees its
    call queue close (it holds both ends of that pipe), so it would outlive a killed server."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    parent = multiprocessing.parent_process()
    if parent is not None:
        threading.Thread(
            target=_exit_with, args=(parent.sentinel,), name="exit-with-server", daemon=True
        ).start()


def _exit_with(parent_sentinel: int) -> None:
    multiprocessing.connection.wait([parent_sentinel])  # readable once the server process is gone
    os._exit(0)


def _replace(pool: ProcessPoolExecutor | None) -> None:
    """Drop a failed (broken or stuck) pool: the next big body starts a fresh worker."""
    global _executor
    if pool is None:
        return
    with _lock:
        if _executor is pool:
            _executor = None
    _stop(pool)


def _stop(pool: ProcessPoolExecutor) -> None:
    """Stop without waiting: kill the worker (it may be stuck) and fail whatever is queued.
    Before Python 3.14's kill_workers() there is no public way to reach the processes."""
    processes = dict(getattr(pool, "_processes", None) or {})
    for process in processes.values():
        process.kill()
    pool.shutdown(wait=False, cancel_futures=True)


def shutdown() -> None:
    """Called when the app's lifespan ends."""
    global _executor
    with _lock:
        pool, _executor = _executor, None
    if pool is not None:
        _stop(pool)
