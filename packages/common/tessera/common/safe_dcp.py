"""Reading torch.distributed.checkpoint (DCP) directories without running code from them.

DCP stores its index (`.metadata`) as a pickle and reads it with plain `pickle.load`, and reads
every non-tensor entry with `torch.load(weights_only=False)`: a checkpoint someone else made could
run any code the moment a reader opens it (measured: a planted `.metadata` ran its payload in 18 of
18 reader commands, `tessera-ckpt verify` included). Every Tessera reader goes through this module
instead:

- `read_dcp_metadata` unpickles `.metadata` with `RestrictedUnpickler`, which admits only the
  classes DCP's own index is made of (listed below, found by recording what torch 2.13 writes for
  every kind of state Tessera saves) plus plain containers; anything else is refused with one line
  naming the file and the global it asked for. Given the checksum of `.metadata` a Tessera
  sidecar records (`expected_digest`: tessera.common.checkpoint.metadata_digest passes it), the
  bytes are checked against it before they are unpickled at all.
- `SafeFileSystemReader` is DCP's FileSystemReader with that metadata reader, and
  `SafeLoadPlanner` is DCP's default planner with non-tensor entries read `weights_only=True`
  (tensors are already read that way by DCP). `dcp_load` wires both into `dcp.load`.

Rejected alternative: a non-pickle metadata format of our own (JSON). It would also make
checkpoints written by other DCP users (Megatron-Core's `torch_dist`, torchtitan) unreadable, and
DCP's reader would still unpickle if called directly; a restricted unpickler protects every path.
"""

from __future__ import annotations

import io
import math
import pickle
from pathlib import Path
from typing import Any

import torch

from tessera.common.errors import ArtifactError
from tessera.common.fileio import artifact_path, file_digest

METADATA_FILE = ".metadata"

# (module, name) pairs DCP's index pickles reference. Constructing any of them runs no code beyond
# storing fields: dataclasses of sizes/offsets/paths, torch.Size, a dtype/layout lookup.
_DCP_MODULE = "torch.distributed.checkpoint.metadata"
_ALLOWED_GLOBALS: frozenset[tuple[str, str]] = frozenset({
    (_DCP_MODULE, "Metadata"),
    (_DCP_MODULE, "MetadataIndex"),
    (_DCP_MODULE, "StorageMeta"),
    (_DCP_MODULE, "TensorProperties"),
    (_DCP_MODULE, "TensorStorageMetadata"),
    (_DCP_MODULE, "BytesStorageMetadata"),
    (_DCP_MODULE, "ChunkStorageMetadata"),
    (_DCP_MODULE, "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    # Megatron-Core's torch_dist index also keeps its save plans (dataclasses and an Enum).
    ("torch.distributed.checkpoint.planner", "SavePlan"),
    ("torch.distributed.checkpoint.planner", "WriteItem"),
    ("torch.distributed.checkpoint.planner", "WriteItemType"),
    ("torch.distributed.checkpoint.planner", "TensorWriteData"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "slice"),
})


class RestrictedUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata: its own classes, torch dtypes and plain containers, nothing else."""

    def __init__(self, file: Any, source: Path):
        super().__init__(file)
        self._source = source

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise ArtifactError(f"{self._source}: refused to load: it references {module}.{name}, which a checkpoint "
                            "index never contains (the file may be malicious); do not use this checkpoint")


def read_dcp_metadata(directory: str | Path, expected_digest: tuple[str, str] | None = None) -> Any:
    """DCP's `Metadata` of a checkpoint directory, read without admitting foreign code.
    `expected_digest`: (algorithm, hex digest) the file must have, checked before unpickling."""
    directory = Path(directory)
    path = artifact_path(directory, METADATA_FILE)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ArtifactError(f"{path}: DCP index missing; the checkpoint is incomplete") from None
    except OSError as exc:
        raise ArtifactError(f"{path}: cannot read the DCP index ({exc.strerror or exc})") from None
    if expected_digest is not None:
        algorithm, digest = expected_digest
        try:
            actual = file_digest(path, algorithm)
        except (KeyError, ValueError):
            actual = None  # unknown algorithm: read_sidecar refuses it with its own message
        if actual is not None and actual != digest:
            raise ArtifactError(f"{path}: checksum mismatch with the sidecar; the checkpoint index is corrupt "
                                "or was replaced; do not use this checkpoint")
    try:
        metadata = RestrictedUnpickler(io.BytesIO(data), path).load()
    except ArtifactError:
        raise
    except Exception as exc:
        raise ArtifactError(f"{path}: unreadable DCP index ({type(exc).__name__}: "
                            f"{str(exc).splitlines()[0][:160] if str(exc) else ''})") from None
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    if not isinstance(metadata, Metadata):
        raise ArtifactError(f"{path}: not a DCP index (holds {type(metadata).__name__})")
    check_index_sizes(path, metadata)
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    for info in (getattr(metadata, "storage_data", None) or {}).values():  # the payload files DCP will open
        artifact_path(directory, str(getattr(info, "relative_path", "")))
    return metadata


def _dims(value: Any) -> tuple[int, ...] | None:
    """`value` as a shape (a sequence of non-negative ints), or None when it is not one."""
    if not isinstance(value, (tuple, list)) or not all(type(d) is int and d >= 0 for d in value):
        return None
    return tuple(value)


def check_index_sizes(path: Path, metadata: Any) -> None:
    """Before anything is sized from the index: every tensor's shape, dtype and chunks are well
    formed, each chunk lies inside its tensor, and each chunk's stored entry is at least as long as
    the chunk's bytes. So an index claiming a terabyte tensor over a kilobyte entry (checksums
    recomputed to match) is refused here, one line naming the tensor, before a reader allocates it.
    Entries stored with a DCP transform (compression) are not bounded by their length; Tessera
    writes none."""
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        MetadataIndex,
        TensorStorageMetadata,
    )

    def refuse(key: str, what: str) -> None:
        raise ArtifactError(f"{path}: {key!r}: {what}; the DCP index is corrupt or was forged, do not use this "
                            "checkpoint")

    entries = getattr(metadata, "state_dict_metadata", None)
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(entries, dict) or not isinstance(storage, dict):
        raise ArtifactError(f"{path}: not a DCP index (no tensor table or storage table)")
    for key, md in entries.items():
        if isinstance(md, BytesStorageMetadata):
            continue
        if not isinstance(md, TensorStorageMetadata):
            refuse(str(key), f"holds a {type(md).__name__}, not a tensor or bytes entry")
        shape = _dims(md.size)
        dtype = getattr(md.properties, "dtype", None)
        if shape is None or not isinstance(dtype, torch.dtype) or not isinstance(md.chunks, list):
            refuse(key, "malformed tensor entry (shape, dtype or chunk list)")
        for chunk in md.chunks:
            offsets, sizes = _dims(getattr(chunk, "offsets", None)), _dims(getattr(chunk, "sizes", None))
            if offsets is None or sizes is None or not len(offsets) == len(sizes) == len(shape) \
                    or any(o + n > d for o, n, d in zip(offsets, sizes, shape)):
                refuse(key, f"a chunk lies outside its shape {list(shape)}")
            info = storage.get(MetadataIndex(key, offsets))
            length = getattr(info, "length", None)
            if type(length) is not int or type(getattr(info, "offset", None)) is not int or length < 0 \
                    or info.offset < 0:
                refuse(key, f"no valid storage entry for its chunk at {list(offsets)}")
            needed = math.prod(sizes) * dtype.itemsize
            if not getattr(info, "transform_descriptors", None) and length < needed:
                refuse(key, f"shape {list(shape)} ({str(dtype).removeprefix('torch.')}) needs {needed} bytes "
                            f"for a chunk whose stored entry has {length}")


def _reader_class() -> type:
    from torch.distributed.checkpoint import FileSystemReader

    class SafeFileSystemReader(FileSystemReader):
        """DCP's file-system reader serving an index already read by `read_dcp_metadata`.

        The index is read and checked before DCP is involved, so a refusal is one ArtifactError
        (inside `dcp.load` DCP would log its own traceback and retry). Rank-local indexes
        (`__<rank>.metadata`, which Tessera never writes) are reported missing."""

        def __init__(self, path: str | Path, metadata: Any):
            super().__init__(str(path))
            self._metadata = metadata

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            if kwargs.get("rank") is not None:
                raise FileNotFoundError(f"{self.path}: rank-local DCP metadata is not supported")
            self._metadata.storage_meta.load_id = self.load_id
            return self._metadata

    return SafeFileSystemReader


def _planner_class() -> type:
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class SafeLoadPlanner(DefaultLoadPlanner):
        """DCP's default load planner reading non-tensor entries with `torch.load(weights_only=True)`."""

        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            try:
                obj = torch.load(value, weights_only=True)
            except pickle.UnpicklingError as exc:
                raise ArtifactError(f"{read_item.dest_index.fqn}: refused to load a non-tensor entry that is not "
                                    f"plain data ({str(exc).splitlines()[0][:160]}); the checkpoint may be "
                                    "malicious") from None
            if self.flatten_state_dict:
                from torch.distributed.checkpoint._nested_dict import set_element

                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return SafeLoadPlanner


def safe_reader(directory: str | Path, expected_digest: tuple[str, str] | None = None) -> Any:
    """A DCP storage reader for `directory` whose index has been read safely (raises ArtifactError)."""
    return _reader_class()(directory, read_dcp_metadata(directory, expected_digest))


def dcp_load(state: dict, directory: str | Path, no_dist: bool = False,
             expected_digest: tuple[str, str] | None = None) -> None:
    """`dcp.load(state, ...)` in place, through the safe reader and planner (collective unless no_dist).

    A refusal raised inside DCP reaches the caller as the ArtifactError itself (DCP wraps every
    rank's exception in its CheckpointException, a BaseException with a multi-line traceback)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dcp.load(state, storage_reader=safe_reader(directory, expected_digest), planner=_planner_class()(), no_dist=no_dist)
    except CheckpointException as exc:
        for failure in exc.failures.values():
            inner = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(inner, ArtifactError):
                raise inner from None
        raise
