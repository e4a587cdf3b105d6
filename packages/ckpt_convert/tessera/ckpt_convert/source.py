"""Read access to a Tessera checkpoint: its sidecar, its DCP index, and tensors one group at a time.

Converters never hold a whole model: they ask this reader for the few tensors one output tensor
needs, write the result, and drop them. A tensor stored as one whole chunk is its DCP file entry
memory-mapped (mapped.py: no read buffer, no copy; the map goes when the tensor does). A tensor
split over chunks (a payload partitioned for some parallel layout) is assembled here from its
mapped chunks with one copy each, following the DCP index; entries DCP stored with a transform
(e.g. compression) go through `torch.distributed.checkpoint.load` in a single process.
"""

from __future__ import annotations

import math
import os
import threading
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException

from tessera.ckpt_convert.mapped import RangeReader, aligned, load_saved_tensor
from tessera.common.checkpoint import (
    MODEL_PREFIX,
    SIDECAR,
    CheckpointSidecar,
    check_checkpoint,
    check_extents,
    check_payload_listed,
    checkpoint_tokenizer_dir,
    metadata_digest,
    read_sidecar,
    resolve_checkpoint,
    single_process_dcp,
)
from tessera.common.errors import ArtifactError
from tessera.common.fileio import artifact_path, file_digest
from tessera.common.safe_dcp import dcp_load
from tessera.common.tokenizer import Tokenizer, check_tokenizer_fits, load_tokenizer


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
        # Before any verb sizes anything from it: every file listed for checking, the index sane and
        # inside its files, the model tensors those of the sidecar's config (no payload byte read).
        check_payload_listed(self.directory, self.sidecar)
        self.metadata: Any = check_checkpoint(self.directory, self.sidecar)

    # ---- the DCP index -------------------------------------------------------------------

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
        d = checkpoint_tokenizer_dir(self.directory)
        return d if (d / "tokenizer.json").is_file() else None

    def tokenizer(self) -> Tokenizer | None:
        """The checkpoint's tokenizer, refused when it has more tokens than the model's vocabulary
        (the check serving makes, made by every verb that reads or copies it)."""
        if self.tokenizer_dir is None:
            return None
        tok = load_tokenizer(self.tokenizer_dir)
        check_tokenizer_fits(tok, self.sidecar.model.vocab_size, str(self.directory / SIDECAR))
        return tok

    def check_integrity(self) -> None:
        """Every indexed item lies inside its file and every payload file matches its checksum."""
        with self.checksum_check() as check:
            check.wait()

    def checksum_check(self) -> ChecksumCheck:
        """Check extents now (catches truncation before any work) and start hashing the payload
        files in a background thread (hashlib releases the GIL) while the conversion runs.

        Use as a context manager around the conversion and call `.wait()` before committing the
        output, so a corrupt input still leaves nothing behind; leaving the block on an error
        cancels the hashing."""
        self.check_extents()
        return ChecksumCheck(self.directory, dict(self.sidecar.checksums), self.sidecar.checksum_algorithm)

    def check_extents(self) -> None:
        """Every payload file .metadata names exists and holds its items' bytes (stat only, no reading)."""
        check_extents(self.directory, self.metadata)

    # ---- reading ---------------------------------------------------------------------------
    def load(self, keys: list[str], raw: bool = False) -> dict[str, torch.Tensor]:
        """Full global tensors for DCP keys (model or training state).

        raw=True: tensors stored whole come back exactly as mapped, possibly misaligned (see
        mapped.py): fit to be written (through `raw()` or `Staging.ready`) or passed through
        `aligned()`, not to compute on. raw=False makes every tensor safe to compute on."""
        missing = [k for k in keys if k not in self.tensor_specs]
        if missing:
            raise ArtifactError(f"{self.directory}: checkpoint has no tensor {missing[0]!r}")
        out: dict[str, torch.Tensor] = {}
        rest = []
        for k in keys:
            direct = self._load_whole_chunk(k)
            if direct is None:
                direct = self._assemble(k)
            if direct is None:
                rest.append(k)
            else:
                out[k] = direct
        if rest:
            out.update(self._load_dcp(rest))
        return {k: out[k] if raw else aligned(out[k]) for k in keys}

    def _load_whole_chunk(self, key: str) -> torch.Tensor | None:
        """A tensor stored as one untransformed chunk: its file entry, memory-mapped (no copy).
        Returns None when the tensor is split over chunks."""
        md = self.metadata.state_dict_metadata[key]
        if len(md.chunks) != 1 or tuple(md.chunks[0].sizes) != tuple(md.size):
            return None
        return self._read_chunk(key, 0)

    def _read_chunk(self, key: str, index: int) -> torch.Tensor | None:
        """Chunk `index` of a stored tensor as a tensor over its mapped file entry; None if DCP
        stored it with a transform (then DCP must read it)."""
        from torch.distributed.checkpoint.metadata import MetadataIndex

        md = self.metadata.state_dict_metadata[key]
        chunk = md.chunks[index]
        info = self.metadata.storage_data[MetadataIndex(key, chunk.offsets)]
        if info.transform_descriptors:
            return None
        path = self.directory / info.relative_path
        try:
            tensor = load_saved_tensor(path, info.offset, info.length)
        except Exception:
            # Not readable in place (or torch's loader internals changed): read it the plain way,
            # which also produces the error message when the entry is corrupt.
            tensor = self._read_entry_copy(path, key, info)
        if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != tuple(chunk.sizes) \
                or tensor.dtype != md.properties.dtype:
            raise ArtifactError(f"{path}: entry {key!r} does not match the DCP index; the checkpoint is corrupt")
        return tensor

    @staticmethod
    def _read_entry_copy(path: Path, key: str, info: Any) -> Any:
        try:
            with open(path, "rb", buffering=0) as f:
                return torch.load(RangeReader(f.fileno(), info.offset, info.length), map_location="cpu", weights_only=True)
        except Exception as exc:
            raise ArtifactError(f"{path}: failed to read {key!r} ({str(exc).strip().splitlines()[0][:160]}); "
                                "the checkpoint is corrupt or truncated (run `tessera-ckpt verify`)") from None

    def _assemble(self, key: str) -> torch.Tensor | None:
        """A tensor split over chunks: each chunk mapped and copied once into the global tensor.
        None when a chunk needs DCP (a transform), or the chunks do not tile the tensor exactly
        (then DCP, which knows every layout it writes, assembles it)."""
        md = self.metadata.state_dict_metadata[key]
        shape = tuple(md.size)
        if sum(math.prod(c.sizes) for c in md.chunks) != math.prod(shape):
            return None
        out = torch.empty(shape, dtype=md.properties.dtype)
        for index, chunk in enumerate(md.chunks):
            piece = self._read_chunk(key, index)
            if piece is None:
                return None
            region = out
            for dim, (off, size) in enumerate(zip(chunk.offsets, chunk.sizes)):
                if off + size > shape[dim]:
                    raise ArtifactError(f"{self.directory}: chunk of {key!r} at {list(chunk.offsets)} lies outside "
                                        f"its shape {list(shape)}; the DCP index is corrupt")
                region = region.narrow(dim, off, size)
            region.copy_(aligned(piece))
            del piece
        return out

    def _load_dcp(self, keys: list[str]) -> dict[str, torch.Tensor]:
        state = {k: torch.empty(self.tensor_specs[k].shape, dtype=self.tensor_specs[k].dtype) for k in keys}
        try:
            with single_process_dcp():
                dcp_load(state, self.directory, no_dist=True, expected_digest=metadata_digest(self.directory))
        except ArtifactError:
            raise
        except (Exception, CheckpointException) as exc:  # DCP's CheckpointException is a BaseException
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ArtifactError(f"{self.directory}: failed to read {keys[0]!r} ({first[:200]}); "
                                "the checkpoint is corrupt or truncated (run `tessera-ckpt verify`)") from None
        return state

    def load_model(self, names: list[str], raw: bool = False) -> dict[str, torch.Tensor]:
        """Model tensors by parameter name (`raw` as for `load`)."""
        loaded = self.load([MODEL_PREFIX + n for n in names], raw)
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


class ChecksumCheck:
    """Each payload file's checksum against the sidecar, in a cancellable background thread."""

    def __init__(self, directory: Path, checksums: dict[str, str], algorithm: str):
        self.directory, self.checksums, self.algorithm = directory, checksums, algorithm
        self._cancel = threading.Event()
        self._error: BaseException | None = None
        # Daemon: an interrupted conversion must not wait for the hashing of a large input.
        self._thread = threading.Thread(target=self._run, name="checksum", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for name, digest in self.checksums.items():
                path = artifact_path(self.directory, name)
                if not path.is_file():
                    raise ArtifactError(f"{path}: checkpoint file missing")
                got = file_digest(path, self.algorithm, self._cancel)
                if got is None:  # cancelled
                    return
                if got != digest:
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
