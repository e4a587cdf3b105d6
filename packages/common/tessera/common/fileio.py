"""Atomic writes and content hashing.

Every artifact is written under a temporary name and renamed into place only when complete, so
an interrupted run never leaves a file or directory that looks finished.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

_CHUNK = 1 << 22  # 4 MiB


def sha256_file(path: str | os.PathLike, chunk_size: int = _CHUNK) -> str:
    """Hex SHA-256 of a file, read in chunks so memory stays flat for any file size."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk_size):
            digest.update(block)
    return digest.hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def tmp_name(path: str | os.PathLike) -> Path:
    """A sibling temporary name for `path` (same directory, so the final rename is atomic)."""
    path = Path(path)
    return path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def _fsync_dir(directory: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike, mode: str = "wb") -> Iterator[Any]:
    """Open a temporary sibling of `path` for writing; rename it to `path` on success."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = tmp_name(path)
    try:
        with open(tmp, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    with atomic_file(path, "wb") as f:
        f.write(data)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


@contextlib.contextmanager
def atomic_directory(path: str | os.PathLike, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary directory that becomes `path` when the block completes.

    On any exception the temporary directory is removed and `path` is untouched. With
    `overwrite`, an existing `path` is replaced only after the new one is complete.
    """
    path = Path(path)
    if path.exists() and not overwrite:
        raise FileExistsError(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = tmp_name(path)
    tmp.mkdir()
    try:
        yield tmp
        if path.exists():
            old = tmp_name(path)
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
        _fsync_dir(path.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def read_json(path: str | os.PathLike, what: str = "file") -> Any:
    """Read a JSON file, turning absence or corruption into a one-line ArtifactError."""
    from tessera.common.errors import ArtifactError

    path = Path(path)
    if not path.is_file():
        raise ArtifactError(f"{path}: {what} not found")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ArtifactError(f"{path}: not valid JSON ({exc.msg if hasattr(exc, 'msg') else exc}); "
                            f"the {what} is corrupt, rebuild it") from None
