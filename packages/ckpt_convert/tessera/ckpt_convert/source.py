"""Read access to a Tessera checkpoint: its sidecar, its DCP index, and tensors one group at a time.

Converters never hold a whole model: they ask this reader for the few tensors one output tensor
needs, write the result, and drop them. Reading goes through `torch.distributed.checkpoint` in a
single process (no process group), so a payload saved under any parallel layout reads the same:
DCP assembles global tensors from whatever chunks the files hold.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from tessera.common.checkpoint import (
    MODEL_PREFIX,
    SIDECAR,
    TOKENIZER_DIR,
    CheckpointSidecar,
    read_sidecar,
    resolve_checkpoint,
    verify_checksums,
)
from tessera.common.errors import ArtifactError
from torch.distributed.checkpoint.api import CheckpointException


@dataclass(frozen=True)
class TensorSpec:
    """Global shape and dtype of one stored tensor."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=self.dtype).element_size()


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
        """Checksums of every payload file (as recorded in the sidecar) and every indexed item
        inside its file; run before converting so a corrupt or truncated input fails up front."""
        if self.sidecar.checksums:
            verify_checksums(self.directory, self.sidecar)
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

    def payload_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.directory.iterdir() if p.is_file() and p.name != SIDECAR)

    # ---- reading ---------------------------------------------------------------------------
    def load(self, keys: list[str]) -> dict[str, torch.Tensor]:
        """Full global tensors for DCP keys (model or training state)."""
        import torch.distributed.checkpoint as dcp

        missing = [k for k in keys if k not in self.tensor_specs]
        if missing:
            raise ArtifactError(f"{self.directory}: checkpoint has no tensor {missing[0]!r}")
        state = {k: torch.empty(self.tensor_specs[k].shape, dtype=self.tensor_specs[k].dtype) for k in keys}
        try:
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
