"""The relay's aiohttp session (fornax/router/upstream.py), against a raw asyncio server: a
replica gets the client's headers and nothing else (no cookie a replica set, none of
aiohttp's own), the connection is reused, and a silent replica is a ClientError (a failed
attempt) after --read-timeout."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from fornax.router.config import RouterConfig
from fornax.router.upstream import ClientError, open_session, send

OK = b"HTTP/1.1 200 OK\r\nset-cookie: session=leak\r\ncontent-length: 2\r\n\r\n{}"
Answer = Callable[[asyncio.StreamWriter], Awaitable[None]]


async def serve(answer: Answer, heads: list[bytes], peers: set[object]) -> asyncio.Server:
    """Records each request's head and the connection it came on; `answer` replies."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while head := await reader.readuntil(b"\r\n\r\n"):
                lines = head.lower().split(b"\r\n")
                length = next(
                    int(line.split(b":")[1]) for line in lines if line.startswith(b"content-length:")
                )
                await reader.readexactly(length)
                heads.append(head)
                peers.add(writer.get_extra_info("peername"))
                await answer(writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    return await asyncio.start_server(handle, "127.0.0.1", 0)


def url_of(server: asyncio.Server) -> str:
    return f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


async def reply_ok(writer: asyncio.StreamWriter) -> None:
    writer.write(OK)


async def reply_never(writer: asyncio.StreamWriter) -> None:
    await asyncio.sleep(10)


def test_only_the_clients_headers_and_no_cookies() -> None:
    async def run() -> tuple[list[bytes], set[object]]:
        heads: list[bytes] = []
        peers: set[object] = set()
        server = await serve(reply_ok, heads, peers)
        session = open_session(RouterConfig())
        try:
            for _ in range(2):
                resp = await send(
                    session, "POST", url_of(server), "/v1/completions", b"{}", {"authorization": "Bearer k"}
                )
                assert resp.status == 200 and await resp.read() == b"{}"
                resp.release()
        finally:
            await session.close()
            server.close()
        return heads, peers

    heads, peers = asyncio.run(run())
    for head in heads:
        names = sorted(line.split(b":")[0].lower() for line in head.split(b"\r\n")[1:] if line)
        assert names == [b"authorization", b"content-length", b"host"]  # the second has no cookie either
    assert len(peers) == 1  # one kept-alive connection


def test_a_silent_replica_is_a_client_error() -> None:
    async def run() -> None:
        server = await serve(reply_never, [], set())
        session = open_session(RouterConfig(read_timeout_s=0.2))
        try:
            with pytest.raises(ClientError):
                await send(session, "POST", url_of(server), "/v1/completions", b"{}", {})
        finally:
            await session.close()
            server.close()

    asyncio.run(run())
