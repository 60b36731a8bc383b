"""Who may call a server: user and admin keys from flags, files and the environment, and the
per-key rate limits."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fornax.config.common import ConfigError
from fornax.config.environment import env_admin_key, env_admin_key_file, env_api_key, env_api_key_file


def load_api_keys(
    keys: list[str] | tuple[str, ...] = (), key_file: str | None = None
) -> tuple[tuple[str, str], ...]:
    """(name, key) pairs of user keys from `--api-key` values, FORNAX_API_KEY and a key file.

    A key file holds one key per line, optionally `name:key`; blank lines and `#` comments are
    skipped. Keys given without a name are called `key-<n>` (n counts from 1 in order given), so
    per-key usage never shows a secret.
    """
    return _load_keys(list(keys), env_api_key(), key_file or env_api_key_file(), "key")


def load_admin_keys(
    keys: list[str] | tuple[str, ...] = (), key_file: str | None = None
) -> tuple[tuple[str, str], ...]:
    """Operator keys, as `load_api_keys`, from `--admin-key`, FORNAX_ADMIN_KEY and
    `--admin-key-file` (or FORNAX_ADMIN_KEY_FILE); unnamed ones are called `admin-<n>`."""
    return _load_keys(list(keys), env_admin_key(), key_file or env_admin_key_file(), "admin")


def _load_keys(
    raw: list[str], env_key: str | None, path: str | None, prefix: str
) -> tuple[tuple[str, str], ...]:
    if env_key:
        raw.append(env_key)
    if path:
        try:
            text = Path(path).expanduser().read_text()
        except OSError as exc:
            raise ConfigError(f"cannot read the API key file {path}: {exc.strerror}") from exc
        raw += [
            line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")
        ]
    pairs: list[tuple[str, str]] = []
    for n, entry in enumerate(raw, start=1):
        name, sep, key = entry.partition(":")
        name, key = (
            (name.strip(), key.strip()) if sep and name.strip() and key.strip() else (f"{prefix}-{n}", entry)
        )
        if not key:
            raise ConfigError("an API key must not be empty")
        pairs.append((name, key))
    return tuple(pairs)


PREFIX_CACHE_SCOPES = ("global", "key")
RATE_LIMIT_FIELDS = ("requests_per_minute", "tokens_per_minute")


@dataclass(frozen=True)
class RateLimit:
    """One key's budget over any 60 s window (None: unlimited). Tokens are prompt tokens plus
    the completion tokens the request may produce (server/rate_limit.py says how they count)."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None

    def __post_init__(self) -> None:
        for name in RATE_LIMIT_FIELDS:
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ConfigError(f"{name} must be a positive integer or null, got {value!r}")

    @property
    def unlimited(self) -> bool:
        return self.requests_per_minute is None and self.tokens_per_minute is None


def load_key_limits(
    path: str | None = None, requests_per_minute: int | None = None, tokens_per_minute: int | None = None
) -> tuple[tuple[str, RateLimit], ...]:
    """Per-key rate limits from `--key-limits FILE` and the `--rate-limit-rpm/-tpm` defaults.

    The file is JSON: {"alice": {"requests_per_minute": 60, "tokens_per_minute": 20000}, "*": {...}}.
    "*" is the default of every key the file does not name; the flags override the file's "*"
    (the command line is the more specific source); a key's own entry overrides both, field by
    field (null: unlimited). Returns (name, limit) pairs, "*" included, or () without any limit.
    """
    entries = _read_key_limits(path) if path else {}
    default = dict(entries.pop("*", {}))
    for name, flag in zip(RATE_LIMIT_FIELDS, (requests_per_minute, tokens_per_minute)):
        if flag is not None:
            default[name] = flag
    out = [("*", RateLimit(**default))]
    out += [(name, RateLimit(**(default | fields_))) for name, fields_ in entries.items()]
    return () if all(limit.unlimited for _, limit in out) else tuple(out)


def _read_key_limits(path: str) -> dict[str, dict[str, int | None]]:
    import json

    try:
        value = json.loads(Path(path).expanduser().read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read the key limits file {path}: {exc.strerror}") from exc
    except json.JSONDecodeError as exc:
        raise ConfigError(f"the key limits file {path} is not valid JSON: {exc}") from exc
    if not isinstance(value, dict) or not all(isinstance(v, dict) for v in value.values()):
        raise ConfigError(f"the key limits file {path} must map key names to objects")
    for name, fields_ in value.items():
        unknown = sorted(set(fields_) - set(RATE_LIMIT_FIELDS))
        if unknown:
            raise ConfigError(
                f"key limits for {name!r}: unknown field(s) {unknown}; known: {list(RATE_LIMIT_FIELDS)}"
            )
    return value
