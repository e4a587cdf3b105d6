"""Read access to a Tessera checkpoint: its sidecar, its DCP index, and tensors one group at a time.

Converters never hold a whole model: they ask this reader for the few tensors one output tensor
needs, write the result, and drop them. A tensor stored as one whole chunk is read straight from
its DCP file entry; a tensor split over chunks (a payload partitioned for some parallel layout)
goes through `torch.distributed.checkpoint.load` in a single process (no process group), which
assembles the global tensor from whatever chunks the files hold.
"""

from __future__ import annotations

import hashlib
import io
import math
import os
import threading
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException

from tessera.common.checkpoint import (
    MODEL_PREFIX,
    TOKENIZER_DIR,
    CheckpointSidecar,
    read_sidecar,
    resolve_checkpoint,
    single_process_dcp,
)
from tessera.common.errors import ArtifactError


@dataclass(frozen=True)
class TensorSpec:
    """Global shape and dtype of one stored tensor."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class CheckpointSource:
    """One resolved checkpoint directory (iteration dir, checkpoints dir with pointer, or run dir)."""

    def __init__(self, path: str | os.PathLike):
        self.directory: Path = resolve_checkpoint(path)
        self.sidecar: CheckpointSidecar = read_sidecar(self.directory)

    # ---- the DCP index -------------------------------------------------------------------
    @cached_property
    def metadata(self) -> Any:
        from torch.distributed.checkpoint import FileSystemReader

        if not (self.directory / ".metadata").is_file():
            raise ArtifactError(f"{self.directory}: DCP index .metadata missing; the checkpoint is incomplete")
        try:
            return FileSystemReader(str(self.directory)).read_metadata()
        except Exception as exc:
            raise ArtifactError(f"{self.directory / '.metadata'}: unreadable DCP index "
                                f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})") from None

    @cached_property
    def tensor_specs(self) -> dict[str, TensorSpec]:
        """Every stored tensor (model and training state), full DCP key -> spec, in stored order."""
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        return {key: TensorSpec(tuple(md.size), md.properties.dtype)
                for key, md in self.metadata.state_dict_metadata.items()
                if isinstance(md, TensorStorageMetadata)}

    @cached_property
    def bytes_keys(self) -> list[str]:
        """Keys of non-tensor entries (pickled Python objects such as scheduler or RNG state)."""
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata

        return [key for key, md in self.metadata.state_dict_metadata.items()
                if isinstance(md, BytesStorageMetadata)]

    @cached_property
    def model_specs(self) -> dict[str, TensorSpec]:
        """Model tensors only, keyed by parameter name (without the `model.` prefix)."""
        return {k[len(MODEL_PREFIX):]: v for k, v in self.tensor_specs.items() if k.startswith(MODEL_PREFIX)}

    @property
    def tokenizer_dir(self) -> Path | None:
        d = self.directory / TOKENIZER_DIR
        return d if (d / "tokenizer.json").is_file() else None

    def check_integrity(self) -> None:
        """Every indexed item lies inside its file and every payload file matches its SHA-256."""
        with self.checksum_check() as check:
            check.wait()

    def checksum_check(self) -> ChecksumCheck:
        """Check extents now (catches truncation before any work) and start hashing the payload
        files in a background thread (hashlib releases the GIL) while the conversion runs.

        Use as a context manager around the conversion and call `.wait()` before committing the
        output, so a corrupt input still leaves nothing behind; leaving the block on an error
        cancels the hashing."""
        self._check_extents()
        return ChecksumCheck(self.directory, dict(self.sidecar.checksums))

    def _check_extents(self) -> None:
        sizes: dict[str, int] = {}
        for index, info in (self.metadata.storage_data or {}).items():
            path = self.directory / info.relative_path
            if info.relative_path not in sizes:
                if not path.is_file():
                    raise ArtifactError(f"{path}: checkpoint file missing (listed in .metadata)")
                sizes[info.relative_path] = path.stat().st_size
            if info.offset + info.length > sizes[info.relative_path]:
                raise ArtifactError(f"{path}: truncated ({index.fqn} ends at byte {info.offset + info.length}, "
                                    f"the file has {sizes[info.relative_path]})")

    # ---- reading ---------------------------------------------------------------------------
    def load(self, keys: list[str]) -> dict[str, torch.Tensor]:
        """Full global tensors for DCP keys (model or training state)."""
        missing = [k for k in keys if k not in self.tensor_specs]
        if missing:
            raise ArtifactError(f"{self.directory}: checkpoint has no tensor {missing[0]!r}")
        out: dict[str, torch.Tensor] = {}
        rest = []
        for k in keys:
            direct = self._load_whole_chunk(k)
            if direct is None:
                rest.append(k)
            else:
                out[k] = direct
        if rest:
            out.update(self._load_dcp(rest))
        return {k: out[k] for k in keys}

    def _load_whole_chunk(self, key: str) -> torch.Tensor | None:
        """Fast path: a tensor stored as one untransformed chunk is read straight from its file
        (one copy, page cache -> tensor) instead of through DCP's load-then-copy. Returns None
        when the tensor is split over chunks, so DCP assembles it."""
        from torch.distributed.checkpoint.metadata import MetadataIndex

        md = self.metadata.state_dict_metadata[key]
        if len(md.chunks) != 1 or tuple(md.chunks[0].sizes) != tuple(md.size):
            return None
        info = self.metadata.storage_data[MetadataIndex(key, md.chunks[0].offsets)]
        if info.transform_descriptors:
            return None
        path = self.directory / info.relative_path
        try:
            with open(path, "rb", buffering=0) as f:
                tensor = torch.load(_FileSlice(f, info.offset, info.length), map_location="cpu", weights_only=True)
        except Exception as exc:
            raise ArtifactError(f"{path}: failed to read {key!r} ({str(exc).strip().splitlines()[0][:160]}); "
                                "the checkpoint is corrupt or truncated (run `tessera-ckpt verify`)") from None
        if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != tuple(md.size) \
                or tensor.dtype != md.properties.dtype:
            raise ArtifactError(f"{path}: entry {key!r} does not match the DCP index; the checkpoint is corrupt")
        return tensor

    def _load_dcp(self, keys: list[str]) -> dict[str, torch.Tensor]:
        import torch.distributed.checkpoint as dcp

        state = {k: torch.empty(self.tensor_specs[k].shape, dtype=self.tensor_specs[k].dtype) for k in keys}
        try:
            with single_process_dcp():
                dcp.load(state, checkpoint_id=str(self.directory), no_dist=True)
        except (Exception, CheckpointException) as exc:  # DCP's CheckpointException is a BaseException
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ArtifactError(f"{self.directory}: failed to read {keys[0]!r} ({first[:200]}); "
                                "the checkpoint is corrupt or truncated (run `tessera-ckpt verify`)") from None
        return state

    def load_model(self, names: list[str]) -> dict[str, torch.Tensor]:
        """Model tensors by parameter name."""
        loaded = self.load([MODEL_PREFIX + n for n in names])
        return {k[len(MODEL_PREFIX):]: v for k, v in loaded.items()}

    def raw_bytes_item(self, key: str) -> tuple[bytes, Any]:
        """The stored bytes of a non-tensor entry, uninterpreted (never unpickled), and its storage info.

        Resharding copies these blobs verbatim, so training state we do not understand passes
        through without being deserialised.
        """
        from torch.distributed.checkpoint.metadata import MetadataIndex

        info = self.metadata.storage_data[MetadataIndex(key)]
        path = self.directory / info.relative_path
        with open(path, "rb") as f:
            f.seek(info.offset)
            data = f.read(info.length)
        if len(data) != info.length:
            raise ArtifactError(f"{path}: truncated (entry {key!r} runs past the end of the file)")
        return data, info


class _FileSlice(io.RawIOBase):
    """A read-only, seekable view of bytes [offset, offset + length) of an open file, so
    `torch.load` can read one DCP entry in place."""

    def __init__(self, f: Any, offset: int, length: int):
        super().__init__()
        self.f, self.start, self.length = f, offset, length
        self.pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.length}[whence]
        self.pos = max(0, min(self.length, base + offset))
        return self.pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        n = min(len(view), self.length - self.pos)
        if n <= 0:
            return 0
        self.f.seek(self.start + self.pos)
        got = self.f.readinto(view[:n])
        self.pos += got or 0
        return got or 0


class ChecksumCheck:
    """SHA-256 of each payload file against the sidecar, in a cancellable background thread."""

    def __init__(self, directory: Path, checksums: dict[str, str]):
        self.directory, self.checksums = directory, checksums
        self._cancel = threading.Event()
        self._error: BaseException | None = None
        # Daemon: an interrupted conversion must not wait for the hashing of a large input.
        self._thread = threading.Thread(target=self._run, name="checksum", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for name, digest in self.checksums.items():
                path = self.directory / name
                if not path.is_file():
                    raise ArtifactError(f"{path}: checkpoint file missing")
                h = hashlib.sha256()
                with open(path, "rb") as f:
                    while block := f.read(1 << 22):
                        if self._cancel.is_set():
                            return
                        h.update(block)
                if h.hexdigest() != digest:
                    raise ArtifactError(f"{path}: checksum mismatch; the checkpoint file is corrupt or truncated")
        except BaseException as exc:  # reported to the caller by wait()
            self._error = exc

    def wait(self) -> None:
        self._thread.join()
        if self._error is not None:
            raise self._error

    def __enter__(self) -> ChecksumCheck:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *rest: object) -> None:
        if exc_type is None:
            return
        if issubclass(exc_type, ArtifactError):
            # A read failed: a checksum mismatch, if there is one, says more precisely what is wrong.
            self._thread.join()
            if isinstance(self._error, ArtifactError):
                raise self._error
        self._cancel.set()
