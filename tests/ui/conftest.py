"""The browser tests reuse the server tests' real `fornax serve` subprocess fixture."""

from tests.server.conftest import make_server  # noqa: F401 - a fixture, found by name
