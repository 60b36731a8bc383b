"""Speculative decoding's tests, in one place from the proposers up to the server; the server
tests start real servers as tests/server does."""

from tests.server.conftest import make_server  # noqa: F401 (a fixture: pytest finds it here)
