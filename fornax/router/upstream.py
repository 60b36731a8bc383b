"""The HTTP client relayed requests go out on: one aiohttp session for the router's life,
created on its running loop at startup and closed at shutdown. (The poller keeps httpx: a
few requests a second, on a client of its own.)

The session is set up to relay, not to browse:
- at most --max-connections requests in flight, all replicas together; more wait for a
  connection (the router's own limit, not a replica's fault, so no timeout on that wait);
- --connect-timeout bounds opening a connection, --read-timeout the longest silence from a
  replica (a paused read, the consumer being slow, is not counted: aiohttp drops the timer);
- idle connections are let go after KEEPALIVE_S, under uvicorn's 5 s: aiohttp does not
  resend a POST that meets an idle connection the replica closed as the request went out,
  and that failure would eject a healthy replica;
- no cookie jar (a Set-Cookie from a replica must not reach other clients' requests), no
  redirects, no decompression and none of aiohttp's default headers: a replica gets the
  client's headers (proxy.upstream_headers) and its answer is relayed as it was sent.

What the proxy reads of an answer: `status`, `headers`, `read()`, `content.iter_any()`, and
`release()`, which keeps the connection when the body was read to its end and closes it
otherwise (which is how a replica learns that the client left: it aborts the generation).
Every failure to reach or hear a replica is an `aiohttp.ClientError` (`ClientError` below),
timeouts included.
"""

from __future__ import annotations

from collections.abc import Mapping

import aiohttp
import httpx

from fornax.router.config import RouterConfig

ClientError = aiohttp.ClientError
KEEPALIVE_S = 4.0
# Headers aiohttp would add on its own; the client's own, if it sent them, still go through.
NO_AUTO_HEADERS = ("Accept", "Accept-Encoding", "Content-Type", "User-Agent")


def open_session(config: RouterConfig) -> aiohttp.ClientSession:
    """The relay's session; call on the loop that will use it."""
    # The poller's trust (httpx's: certifi), so polls and relayed requests agree on a replica.
    connector = aiohttp.TCPConnector(
        limit=config.max_connections,
        limit_per_host=0,
        keepalive_timeout=KEEPALIVE_S,
        ssl=httpx.create_ssl_context(),
    )
    timeout = aiohttp.ClientTimeout(
        total=None, connect=None, sock_connect=config.connect_timeout_s, sock_read=config.read_timeout_s
    )
    return aiohttp.ClientSession(
        connector=connector,
        timeout=timeout,
        cookie_jar=aiohttp.DummyCookieJar(),
        skip_auto_headers=NO_AUTO_HEADERS,
        auto_decompress=False,
        trust_env=False,
    )


async def send(
    session: aiohttp.ClientSession,
    method: str,
    base_url: str,
    path: str,
    body: bytes,
    headers: Mapping[str, str],
) -> aiohttp.ClientResponse:
    """Send; the answer once its head is in. Its body streams: read it, then `release()`."""
    data = body if method == "POST" else None
    return await session.request(method, base_url + path, data=data, headers=headers, allow_redirects=False)
