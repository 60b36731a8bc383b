"""The process's environment and machine: every environment variable fornax reads is read
here and nowhere else (docs/architecture.md, rule 4), and the machine's memory."""

from __future__ import annotations

import os
from pathlib import Path


def env_fornax_home() -> str | None:
    """FORNAX_HOME as set, or None (the cluster hands an explicit one on to its replicas)."""
    return os.environ.get("FORNAX_HOME") or None


def fornax_home() -> Path:
    """Cache root for fetched models and built kernels (FORNAX_HOME, default ~/.cache/fornax)."""
    return Path(env_fornax_home() or Path.home() / ".cache" / "fornax").expanduser()


def debug_checks_enabled() -> bool:
    """FORNAX_DEBUG=1: checks too costly for every step by default, such as the range of the
    indices handed to the native kernels (layers/native.py)."""
    return os.environ.get("FORNAX_DEBUG", "").strip().lower() in ("1", "true", "yes", "on")


def env_c_compiler() -> str | None:
    """CC: the C compiler that builds the native kernels (None: cc or gcc on PATH)."""
    return os.environ.get("CC") or None


def env_isa() -> str | None:
    """FORNAX_ISA: the highest instruction-set level the native kernels may use (layers/isa.py
    LEVELS), for testing and measuring a lower level on a bigger CPU; None: the CPU's own."""
    return os.environ.get("FORNAX_ISA", "").strip().lower() or None


def env_api_key() -> str | None:
    return os.environ.get("FORNAX_API_KEY") or None


def env_api_key_file() -> str | None:
    return os.environ.get("FORNAX_API_KEY_FILE") or None


def env_admin_key() -> str | None:
    return os.environ.get("FORNAX_ADMIN_KEY") or None


def env_admin_key_file() -> str | None:
    return os.environ.get("FORNAX_ADMIN_KEY_FILE") or None


def machine_memory() -> int:
    """Physical memory, or the cgroup's limit when the process runs under a smaller one."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for limit_file in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(limit_file).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return total
