"""The router's replica pool (fornax/router/pool.py) against raw asyncio servers that answer
exactly as each test needs: keep-alive reuse, chunked and read-to-close bodies, a 1xx
before the answer, the idle connection a replica closed as a request went out, silence,
refused connections, the connection limit, and a body larger than the pause mark."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import httpx
import pytest

from fornax.router.config import RouterConfig
from fornax.router.pool import HIGH_WATER, ReplicaPool, request_head

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[bool]]
OK = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"


async def read_request(reader: asyncio.StreamReader) -> bytes | None:
    """One request (head and content-length body), or None at EOF."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return None
    lines = head.lower().split(b"\r\n")
    length = next((int(line.split(b":")[1]) for line in lines if line.startswith(b"content-length:")), 0)
    return head + await reader.readexactly(length)


class RawServer:
    """Calls `handler(reader, writer, n)` for the n-th request on each connection (1-based);
    it answers, and returns False to close the connection. Records every request."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.requests: list[bytes] = []
        self.connections = 0

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        n = 0
        try:
            while (request := await read_request(reader)) is not None:
                n += 1
                self.requests.append(request)
                if not await self.handler(reader, writer, n):
                    break
                await writer.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()


def pool(**kw: object) -> ReplicaPool:
    return ReplicaPool(RouterConfig(**kw))  # type: ignore[arg-type]


async def answer(writer: asyncio.StreamWriter, data: bytes = OK) -> bool:
    writer.write(data)
    return True


def test_request_head_is_one_http11_head() -> None:
    from fornax.router.pool import origin_of

    head = request_head(origin_of("http://[::1]:8000"), "/v1/completions", {"authorization": "Bearer k"}, 12)
    assert head == (b"POST /v1/completions HTTP/1.1\r\nhost: [::1]:8000\r\ncontent-length: 12\r\n"
                    b"authorization: Bearer k\r\n\r\n")  # fmt: skip


def test_keep_alive_reuse_and_headers() -> None:
    async def main() -> None:
        server = RawServer(lambda r, w, n: answer(w))
        async with server as url:
            p = pool()
            for _ in range(3):
                resp = await p.post(url, "/v1/completions", b'{"a":1}', {"content-type": "application/json"})
                assert resp.status_code == 200 and resp.headers["content-type"] == "application/json"
                assert await resp.aread() == b"{}"
                await resp.aclose()
            await p.aclose()
        assert server.connections == 1 and len(server.requests) == 3
        assert server.requests[0].endswith(b'content-type: application/json\r\n\r\n{"a":1}')

    asyncio.run(main())


def test_chunked_stream_arrives_in_order_and_read_to_close_body() -> None:
    async def chunked(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                     b"transfer-encoding: chunked\r\n\r\n")  # fmt: skip
        for i in range(3):
            event = f"data: {i}\n\n".encode()
            writer.write(b"%x\r\n%s\r\n" % (len(event), event))
            await writer.drain()
            await asyncio.sleep(0.01)
        writer.write(b"0\r\n\r\n")
        return True

    async def until_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nall of it")
        return False

    async def main() -> None:
        async with RawServer(chunked) as url:
            p = pool()
            resp = await p.post(url, "/v1/chat/completions", b"{}", {})
            chunks = [chunk async for chunk in resp.aiter_raw()]
            assert b"".join(chunks) == b"data: 0\n\ndata: 1\n\ndata: 2\n\n" and len(chunks) >= 2
            await resp.aclose()
        async with RawServer(until_close) as url:
            resp = await p.post(url, "/v1/completions", b"{}", {})
            assert await resp.aread() == b"all of it"
            await resp.aclose()
        await p.aclose()

    asyncio.run(main())


def test_informational_answer_is_skipped() -> None:
    async def main() -> None:
        async with RawServer(lambda r, w, n: answer(w, b"HTTP/1.1 100 Continue\r\n\r\n" + OK)) as url:
            p = pool()
            resp = await p.post(url, "/v1/completions", b"{}", {})
            assert resp.status_code == 200 and await resp.aread() == b"{}"
            await resp.aclose()
            await p.aclose()

    asyncio.run(main())


def test_idle_connection_closed_by_the_replica_is_retried_once() -> None:
    """The second request on a connection finds it closed unanswered (a keep-alive timeout
    as it went out): it goes again on a new connection, and succeeds."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
        return n == 1 and await answer(writer)

    async def main() -> None:
        server = RawServer(handler)
        async with server as url:
            p = pool()
            for _ in range(2):
                resp = await p.post(url, "/v1/completions", b"{}", {})
                assert await resp.aread() == b"{}"
                await resp.aclose()
            await p.aclose()
        assert server.connections == 2 and len(server.requests) == 3

    asyncio.run(main())


def test_failures_are_httpx_transport_errors() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
        await asyncio.sleep(5)
        return False

    async def half(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabc")
        return False

    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
        writer.write(b"SMTP ready\r\n\r\n")
        return True

    async def main() -> None:
        p = pool(read_timeout_s=0.2, connect_timeout_s=1.0)
        async with RawServer(silent) as url:
            with pytest.raises(httpx.ReadTimeout):
                await p.post(url, "/v1/completions", b"{}", {})
        async with RawServer(half) as url:
            resp = await p.post(url, "/v1/completions", b"{}", {})
            with pytest.raises(httpx.RemoteProtocolError):
                await resp.aread()
            await resp.aclose()
        async with RawServer(garbage) as url:
            with pytest.raises(httpx.RemoteProtocolError):
                await p.post(url, "/v1/completions", b"{}", {})
        with pytest.raises(httpx.ConnectError):
            await p.post(url, "/v1/completions", b"{}", {})  # the server is gone: refused
        await p.aclose()

    asyncio.run(main())


def test_connection_limit_queues_requests() -> None:
    async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
        await asyncio.sleep(0.1)
        return await answer(writer)

    async def one(p: ReplicaPool, url: str) -> bytes:
        resp = await p.post(url, "/v1/completions", b"{}", {})
        try:
            return await resp.aread()
        finally:
            await resp.aclose()

    async def main() -> None:
        server = RawServer(slow)
        async with server as url:
            p = pool(max_connections=1)
            started = asyncio.get_running_loop().time()
            assert await asyncio.gather(*(one(p, url) for _ in range(3))) == [b"{}"] * 3
            assert asyncio.get_running_loop().time() - started >= 0.3  # one at a time
            await p.aclose()
        assert server.connections == 1

    asyncio.run(main())


def test_large_body_past_the_pause_mark_arrives_whole() -> None:
    body = bytes(range(256)) * (3 * HIGH_WATER // 256)

    async def big(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(body) + body)
        return True

    async def main() -> None:
        async with RawServer(big) as url:
            p = pool()
            resp = await p.post(url, "/v1/completions", b"x" * (100 << 10), {})  # a body in its own write
            await asyncio.sleep(0.2)  # everything sent
            assert resp._conn._paused  # reading stopped at the mark: the rest waits in the socket
            assert await resp.aread() == body
            await resp.aclose()
            resp = await p.post(url, "/v1/completions", b"{}", {})  # the same connection, still in step
            assert await resp.aread() == body
            await resp.aclose()
            await p.aclose()

    asyncio.run(main())
