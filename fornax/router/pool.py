"""The keep-alive pool relayed requests go out on: HTTP/1.1 over asyncio protocols, the
answers parsed by httptools.

Why not httpx here: its layers (client, transport, httpcore's pool and connection, anyio's
streams, h11's pure-Python parser) were about 60% of the router's CPU time per relayed
request, and that time is most of what the router adds to a request's latency. What the
router needs is much narrower: POST bytes it already holds to a replica it already chose,
and relay the answer as it arrives. Here a request is one write (head and body), a
response is parsed in C, and its body chunks are handed over as they arrive. (The poller
keeps httpx: a few requests a second.)

What it keeps from httpx, so proxy.py and stream.py treat answers and failures as before:
the response's `status_code`, `headers`, `aread()`, `aiter_raw()` and `aclose()`, and
httpx's transport errors: ConnectError / ConnectTimeout (no connection), ReadTimeout (the
replica silent for --read-timeout), ReadError / RemoteProtocolError (the connection broke,
or the replica sent something that is not HTTP/1.1).

Connections
- One request at a time each, reused while both sides keep them alive; idle ones are used
  newest first, and closed after KEEPALIVE_EXPIRY_S idle or when the replica closes them.
- At most --max-connections requests are in flight, all replicas together (more wait for
  a slot), and at most that many connections are open: an idle one goes to make room.
- A request that fails on a reused connection before any byte of an answer came back is
  sent once more on a new connection: the replica closed the idle connection as the
  request went out (uvicorn does after 5 s), so it never saw the request.
- A response closed before its end closes its connection, which is how the replica learns
  that the client has gone (it aborts the generation).
- Reading pauses while more than HIGH_WATER bytes of a body wait for the consumer, so a slow
  client slows its replica's stream instead of filling the router's memory.
"""

from __future__ import annotations

import asyncio
import functools
import socket
import ssl
from collections import deque
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import cast

import httptools
import httpx
from starlette.datastructures import Headers

from fornax.router.config import RouterConfig

KEEPALIVE_EXPIRY_S = 30.0
HIGH_WATER, LOW_WATER = 256 << 10, 64 << 10  # body bytes waiting for the consumer: pause, resume
JOIN_MAX_BYTES = 64 << 10  # bodies up to this go out in the head's write; larger ones in their own


@dataclass(frozen=True)
class Origin:
    """Where a replica listens, and what its requests say in their Host header."""

    host: str  # as connected to: no IPv6 brackets
    port: int
    host_header: bytes
    tls: bool


@functools.lru_cache(maxsize=4096)
def origin_of(base_url: str) -> Origin:
    """'http://127.0.0.1:8000' -> Origin (replica URLs are normalized: see config.normalize_url)."""
    url = httpx.URL(base_url)
    tls = url.scheme == "https"
    port = url.port or (443 if tls else 80)
    return Origin(url.host, port, url.netloc, tls)


class UpstreamResponse:
    """A replica's answer: status and headers once they are in, then the body as it arrives."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self.status_code = 0
        self.headers = Headers()
        self.keep_alive = False
        self.head_done = False
        self.complete = False
        self.received = False  # any byte of the answer arrived
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._error: httpx.TransportError | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._closed = False

    # -- the consumer's side --
    async def aiter_raw(self) -> AsyncIterator[bytes]:
        while (chunk := await self._next()) is not None:
            yield chunk

    async def aread(self) -> bytes:
        parts = [chunk async for chunk in self.aiter_raw()]
        return parts[0] if len(parts) == 1 else b"".join(parts)

    async def aclose(self) -> None:
        """Done with it: its connection goes back to the pool if the answer was read to its
        end, else it is closed."""
        if not self._closed:
            self._closed = True
            self._conn.finished(self.complete and self.keep_alive and self._error is None)

    async def wait_head(self) -> None:
        while not self.head_done:
            if self._error is not None:
                raise self._error
            await self._wait()

    async def _next(self) -> bytes | None:
        while not self._chunks:
            if self._error is not None:
                raise self._error
            if self.complete:
                return None
            await self._wait()
        chunk = self._chunks.popleft()
        self._buffered -= len(chunk)
        if self._buffered < LOW_WATER:
            self._conn.resume()
        return chunk

    async def _wait(self) -> None:
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    # -- the connection's side --
    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def on_head(self, status: int, raw: list[tuple[bytes, bytes]], keep_alive: bool) -> None:
        self.status_code, self.headers, self.keep_alive = status, Headers(raw=raw), keep_alive
        self.head_done = True
        self._wake()

    def on_body(self, chunk: bytes) -> None:
        self._chunks.append(chunk)
        self._buffered += len(chunk)
        if self._buffered > HIGH_WATER:
            self._conn.pause()
        self._wake()

    def on_complete(self) -> None:
        self.complete = True
        self._wake()

    def fail(self, error: httpx.TransportError) -> None:
        if not self.complete and self._error is None:
            self._error = error
            self._wake()


class Connection(asyncio.Protocol):
    """One connection to a replica: one request at a time; the httptools parser's callbacks
    (on_*) feed the response in progress."""

    def __init__(self, pool: ReplicaPool, origin: Origin) -> None:
        self.pool, self.origin = pool, origin
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.response: UpstreamResponse | None = None
        self.requests = 0  # sent on it so far
        self.idle_since = 0.0
        self.closed = False
        self._raw: list[tuple[bytes, bytes]] = []
        self._informational = False  # a 1xx head: the real answer follows
        self._until_eof = False  # no length and not chunked: the body ends with the connection
        self._paused = False
        self._last_data = 0.0
        self._timer: asyncio.TimerHandle | None = None

    # -- requests --
    def send(self, data: bytes, body: bytes) -> UpstreamResponse:
        assert self.transport is not None and self.response is None
        self.response = UpstreamResponse(self)
        self.requests += 1
        self.transport.write(data)
        if body:
            self.transport.write(body)
        self._last_data = self.loop.time()
        self._timer = self.loop.call_later(self.pool.read_timeout_s, self._check_silence)
        return self.response

    def finished(self, reusable: bool) -> None:
        """The response's consumer is done with it."""
        self.response = None
        self._stop_timer()
        if not reusable:
            self.close()
        self.pool.release(self, reusable and not self.closed)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._stop_timer()
            if self.transport is not None:
                self.transport.close()

    def pause(self) -> None:
        if not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self._paused and self.transport is not None:
            self._paused = False
            self._last_data = self.loop.time()  # the silence was ours
            self.transport.resume_reading()

    def _check_silence(self) -> None:
        silent = self.loop.time() - self._last_data
        timeout = self.pool.read_timeout_s
        if self._paused or silent < timeout:  # not silent for long enough, or the silence is ours
            wait = timeout if self._paused else timeout - silent
            self._timer = self.loop.call_later(wait, self._check_silence)
            return
        self._timer = None
        if self.response is not None:
            self.response.fail(httpx.ReadTimeout(f"the replica sent nothing for {timeout:g}s"))
        self.close()

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    # -- asyncio.Protocol --
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are not asyncio.Transport subclasses
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a head must not wait for an ACK
        self.pool.opened(self)

    def data_received(self, data: bytes) -> None:
        self._last_data = self.loop.time()
        if self.response is None or self.response.complete:  # unasked for: not a connection to keep
            self.close()
            return
        self.response.received = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            error = httpx.RemoteProtocolError(f"the replica's answer is not valid HTTP/1.1: {exc}")
            self.response.fail(error)
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._stop_timer()
        self.pool.lost(self)
        response = self.response
        if response is None or response.complete:
            return
        if response.head_done and self._until_eof and exc is None:
            response.on_complete()
        elif exc is not None:
            response.fail(httpx.ReadError(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__))
        elif not response.head_done:
            response.fail(httpx.RemoteProtocolError("Server disconnected without sending a response."))
        else:
            response.fail(httpx.RemoteProtocolError("peer closed connection without sending complete body"))

    # -- httptools callbacks --
    def on_message_begin(self) -> None:
        self._raw = []

    def on_header(self, name: bytes, value: bytes) -> None:
        self._raw.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        self._informational = 100 <= status < 200
        if self._informational or self.response is None:
            return
        names = {name for name, _ in self._raw}
        self._until_eof = b"content-length" not in names and b"transfer-encoding" not in names
        self.response.on_head(status, self._raw, self.parser.should_keep_alive())

    def on_body(self, body: bytes) -> None:
        if self.response is not None:
            self.response.on_body(body)

    def on_message_complete(self) -> None:
        if self._informational:
            self._informational = False
        elif self.response is not None:
            self._stop_timer()
            self.response.on_complete()


class ReplicaPool:
    def __init__(self, config: RouterConfig) -> None:
        self.max_connections = config.max_connections
        self.connect_timeout_s = config.connect_timeout_s
        self.read_timeout_s = config.read_timeout_s
        # Requests in flight, all replicas together: beyond the limit a request waits for a
        # slot (that is the router's own limit, not a replica's fault).
        self._slots = asyncio.Semaphore(config.max_connections)
        self._idle: dict[Origin, list[Connection]] = {}
        self._open: set[Connection] = set()
        self._tls: ssl.SSLContext | None = None
        self._closing = False

    async def post(self, base_url: str, path: str, body: bytes,
                   headers: Mapping[str, str]) -> UpstreamResponse:  # fmt: skip
        """Send; the answer once its head is in (its body streams: read it or close it)."""
        origin = origin_of(base_url)
        head = request_head(origin, path, headers, len(body))
        data, rest = (head + body, b"") if len(body) <= JOIN_MAX_BYTES else (head, body)
        await self._slots.acquire()
        try:
            return await self._exchange(origin, data, rest)
        except BaseException:
            self._slots.release()
            raise

    async def _exchange(self, origin: Origin, data: bytes, rest: bytes) -> UpstreamResponse:
        while True:
            conn = self._reuse(origin) or await self._connect(origin)
            response = conn.send(data, rest)
            try:
                await response.wait_head()
                return response
            except (httpx.ReadError, httpx.RemoteProtocolError):
                conn.close()
                if conn.requests > 1 and not response.received:
                    continue  # closed by the replica as the request went out: see the docstring
                raise
            except BaseException:  # cancelled (the client left), or timed out: the request is void
                conn.close()
                raise

    def _reuse(self, origin: Origin) -> Connection | None:
        stack = self._idle.get(origin)
        now = asyncio.get_running_loop().time()
        while stack:
            conn = stack.pop()
            if conn.closed:
                continue
            if now - conn.idle_since > KEEPALIVE_EXPIRY_S:
                conn.close()
                continue
            return conn
        return None

    async def _connect(self, origin: Origin) -> Connection:
        if len(self._open) >= self.max_connections:
            self._evict_idle()
        loop = asyncio.get_running_loop()
        tls = self._tls_context() if origin.tls else None
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await loop.create_connection(
                    lambda: Connection(self, origin), origin.host, origin.port,
                    ssl=tls, server_hostname=origin.host if tls else None)  # fmt: skip
        except TimeoutError:
            raise httpx.ConnectTimeout(f"no connection to {origin.host}:{origin.port} within "
                                       f"{self.connect_timeout_s:g}s") from None  # fmt: skip
        except OSError as exc:
            raise httpx.ConnectError(f"{type(exc).__name__}: {exc}") from None
        return conn

    def _tls_context(self) -> ssl.SSLContext:
        if self._tls is None:
            self._tls = httpx.create_ssl_context()  # the same trust as httpx's clients (certifi)
        return self._tls

    def _evict_idle(self) -> None:
        """Close the longest idle connection, to any replica."""
        idle = [conn for stack in self._idle.values() for conn in stack if not conn.closed]
        if idle:
            oldest = min(idle, key=lambda conn: conn.idle_since)
            self._idle[oldest.origin].remove(oldest)
            oldest.close()

    # -- connections report here --
    def opened(self, conn: Connection) -> None:
        self._open.add(conn)

    def lost(self, conn: Connection) -> None:
        self._open.discard(conn)
        stack = self._idle.get(conn.origin)
        if stack and conn in stack:
            stack.remove(conn)

    def release(self, conn: Connection, reusable: bool) -> None:
        if reusable and not self._closing:
            conn.idle_since = asyncio.get_running_loop().time()
            self._idle.setdefault(conn.origin, []).append(conn)
        elif not conn.closed:
            conn.close()
        self._slots.release()

    async def aclose(self) -> None:
        """Close every idle connection, and each busy one as its response is done."""
        self._closing = True
        for stack in self._idle.values():
            for conn in stack:
                conn.close()
        self._idle.clear()


def request_head(origin: Origin, path: str, headers: Mapping[str, str], length: int) -> bytes:
    """The request line and headers, as bytes. Header names and values came from a parsed
    request (no CR or LF can be in them) or from the router's configuration (checked)."""
    parts = [b"POST ", path.encode("ascii"), b" HTTP/1.1\r\nhost: ", origin.host_header,
             b"\r\ncontent-length: ", str(length).encode("ascii"), b"\r\n"]  # fmt: skip
    for name, value in headers.items():
        parts += (name.encode("latin-1"), b": ", value.encode("latin-1"), b"\r\n")
    parts.append(b"\r\n")
    return b"".join(parts)
