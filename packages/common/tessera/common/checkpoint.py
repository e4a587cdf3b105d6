"""The checkpoint artifact: layout on disk, sidecar, pointer, and single-process model access.

    <run>/checkpoints/
        latest_checkpointed_iteration.txt   step number of the newest complete checkpoint
        iter_0000100/
            .metadata, __*_*.distcp          torch.distributed.checkpoint (DCP) files
            tessera_checkpoint.json          the sidecar (CheckpointSidecar), with a checksum per payload file
            tokenizer/                       tokenizer.json + tokenizer_config.json

DCP state-dict keys: `model.<parameter name>` for every model tensor, as global (unsharded)
tensors whatever the layout they were saved from, named as in `tessera.common.models.causal_lm.model` with global
layer numbers; training state under `optimizer.`, `scheduler`, `rng`, `train_state`, etc. (the
trainer owns those). A checkpoint directory is complete only once its sidecar exists, and the
pointer file is replaced (atomically) only after that.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import re
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from torch.distributed.checkpoint.api import CheckpointException

from tessera.common import __version__
from tessera.common.errors import ArtifactError
from tessera.common.fileio import (
    CHECKSUM_ALGORITHMS,
    SHA256,
    XXH3_128,
    artifact_files,
    artifact_path,
    atomic_write_json,
    atomic_write_text,
    file_digest,
    holds_only,
    read_json,
)
from tessera.common.hf.generation import GenerationSettings
from tessera.common.layout import ParallelLayout
from tessera.common.models.registry import DEFAULT_KIND, kind_of, model_config, model_kind
from tessera.common.safe_dcp import METADATA_FILE, dcp_load, read_dcp_metadata

CHECKPOINT_FORMAT = "tessera-checkpoint"
# Version 2: the sidecar names its checksum algorithm (`checksum_algorithm`, XXH3-128 when
# written by this version). Version 1 sidecars have SHA-256 checksums and no such field; they are
# read as before. An older Tessera refuses a version 2 sidecar by its version (a clear message)
# instead of reporting every XXH3 digest as a SHA-256 mismatch.
# Version 3: `layout.pipeline_layers` records the per-stage layer split the checkpoint was saved
# with (a field a version-2 reader would reject as unknown, so the version says it first).
CHECKPOINT_FORMAT_VERSION = 3
SUPPORTED_FORMAT_VERSIONS = (1, 2, 3)
CHECKSUM_ALGORITHM = XXH3_128  # what finalize_checkpoint writes
SIDECAR = "tessera_checkpoint.json"
POINTER = "latest_checkpointed_iteration.txt"
TOKENIZER_DIR = "tokenizer"
MODEL_PREFIX = "model."
CHECKPOINT_KIND = "Tessera checkpoint (a checkpoints directory: its pointer, iter_NNNNNNN/ with their sidecars)"
_ITER_RE = re.compile(r"^iter_(\d{7,})$")
# What a checkpoints directory holds: the pointer, iterations, and what a save in progress leaves
# (the trainer's `.iter_N.partial/`, the pointer's temporary name, fileio.tmp_name).
_CHECKPOINTS_ENTRY_RE = re.compile(r"^(iter_\d{7,}|\.iter_\d{7,}\.partial|" + re.escape(POINTER) + r"|\." + re.escape(POINTER)
                                   + r"\.tmp-.+)$")


class CheckpointSidecar(BaseModel):
    """Contents of `tessera_checkpoint.json`."""

    model_config = ConfigDict(extra="allow", protected_namespaces=())
    format: str = CHECKPOINT_FORMAT
    format_version: int = CHECKPOINT_FORMAT_VERSION
    model: Any = Field(..., description="The model config, as its kind's class (`kind` absent: causal_lm).")
    tokenizer_fingerprint: str | None = None
    layout: ParallelLayout = Field(default_factory=ParallelLayout, description=(
        "Layout it was saved from, with the layer split it ran (pipeline_layers, one count per pipeline stage; "
        "null in sidecars written before the split was recorded). Informational: the stored tensors do not "
        "depend on it; the trainer restores per-rank RNG streams only under an equal layout."))
    step: int = 0
    consumed_samples: int = 0
    consumed_tokens: int = 0
    mixture_fingerprint: str | None = None
    params_dtype: str = "float32"
    contents: list[str] = Field(default_factory=lambda: ["model"], description="Top-level state groups present.")
    checksum_algorithm: str = Field(default=CHECKSUM_ALGORITHM,
                                    description="Algorithm of `checksums`: xxh3-128, or sha256 (format version 1).")
    checksums: dict[str, str] = Field(default_factory=dict, description="File name (DCP files) -> hex digest.")
    generation: GenerationSettings | None = Field(None, description=(
        "The model's generation settings (end ids, sampling defaults) from the generation_config.json it was "
        "imported with; carried by reshard and training, written back by export, applied by the server. "
        "Absent: none recorded (sidecars written before it, models trained from scratch)."))
    created_at: str = Field(default_factory=lambda: _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"))
    tessera_version: str = __version__

    @field_validator("model", mode="before")
    @classmethod
    def _of_its_kind(cls, value: Any) -> Any:
        return value if isinstance(value, BaseModel) else model_config(value)

    @model_validator(mode="before")
    @classmethod
    def _legacy_checksums(cls, data: Any) -> Any:
        # Format version 1 had no checksum_algorithm field: its checksums are SHA-256.
        if isinstance(data, dict) and "checksum_algorithm" not in data and data.get("format_version") == 1:
            data = {**data, "checksum_algorithm": SHA256}
        return data


def iter_dir_name(step: int) -> str:
    return f"iter_{step:07d}"


def checkpoint_files(directory: Path) -> list[Path]:
    """The DCP payload files of a checkpoint directory (not the sidecar or tokenizer)."""
    return [p for p in artifact_files(directory) if p.name != SIDECAR]


def is_checkpoint_output(path: Path) -> bool:
    """A checkpoints directory (the pointer, or an iter_NNNNNNN/ with its sidecar) holding nothing
    else: what reshard and import write (and the trainer), so what their --overwrite may replace
    (fileio.check_replaceable). An interrupted converter leaves only a hidden sibling; an
    interrupted trainer save a `.iter_N.partial/` beside the pointer. Not one iteration directory:
    a checkpoints directory put in place of a run's iteration leaves that run's pointer on a folder
    without sidecar. Nor one holding anything else (a checkpoint_dir that was the user's folder)."""
    if not holds_only(path, _CHECKPOINTS_ENTRY_RE.match):
        return False
    return (path / POINTER).is_file() or any(_ITER_RE.match(p.name) and (p / SIDECAR).is_file() for p in path.iterdir())


def checkpoint_tokenizer_dir(directory: str | os.PathLike) -> Path:
    """The checkpoint's `tokenizer/` folder (refused if it leads outside the checkpoint)."""
    return artifact_path(directory, TOKENIZER_DIR)


def _digest(path: Path) -> str:
    digest = file_digest(path, CHECKSUM_ALGORITHM)
    assert digest is not None  # not cancellable here
    return digest


def finalize_checkpoint(directory: str | os.PathLike, sidecar: CheckpointSidecar,
                        checksums: dict[str, str] | None = None, sync: bool = True) -> None:
    """Checksum the payload and write the sidecar last: the marker that the directory is whole.

    `checksums`: CHECKSUM_ALGORITHM digests of payload files the caller already hashed while
    writing them (file name -> hex); only the files not listed are read back and hashed. The
    sidecar is upgraded to the current format version (its checksums are recomputed). With
    sync=False the sidecar is renamed into place without fsync (tessera-ckpt --no-sync)."""
    from concurrent.futures import ThreadPoolExecutor

    directory = Path(directory)
    files = checkpoint_files(directory)
    known = dict(checksums or {})
    stray = sorted(set(known) - {p.name for p in files})
    if stray:
        raise ValueError(f"finalize_checkpoint: checksums given for files not in {directory}: {stray}")
    todo = [p for p in files if p.name not in known]
    if todo:
        # One file per rank: hash them in parallel (the hashers release the GIL on large blocks).
        with ThreadPoolExecutor(max_workers=max(1, min(len(todo), os.cpu_count() or 1, 8))) as pool:
            known.update(zip((p.name for p in todo), pool.map(_digest, todo)))
    sidecar.format_version = CHECKPOINT_FORMAT_VERSION
    sidecar.checksum_algorithm = CHECKSUM_ALGORITHM
    sidecar.checksums = {p.name: known[p.name] for p in files}
    atomic_write_json(directory / SIDECAR, sidecar.model_dump(mode="json"), sync=sync)


def write_pointer(checkpoints_root: str | os.PathLike, step: int, sync: bool = True) -> None:
    atomic_write_text(Path(checkpoints_root) / POINTER, f"{step}\n", sync=sync)


def read_pointer(checkpoints_root: str | os.PathLike) -> int | None:
    path = artifact_path(checkpoints_root, POINTER)
    if not path.is_file():
        if path.exists():  # a folder of that name: the next save could never replace it
            raise ArtifactError(f"{path}: not a file; remove it (the pointer names the newest checkpoint)")
        return None
    # ASCII digits only: str.isdigit() also takes '²', which int() refuses (a traceback), and a
    # non-UTF-8 pointer failed in read_text().
    text = path.read_bytes().strip()
    if not re.fullmatch(rb"[0-9]+", text):
        raise ArtifactError(f"{path}: expected a step number, found {text.decode('utf-8', 'replace')[:40]!r}")
    return int(text)


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """Accept an iteration directory, a checkpoints directory with a pointer, or a run directory."""
    path = Path(path)
    if not path.exists():
        raise ArtifactError(f"{path}: checkpoint not found")
    if (path / SIDECAR).is_file():
        return path
    for root in (path, path / "checkpoints"):
        step = read_pointer(root) if root.is_dir() else None
        if step is not None:
            target = root / iter_dir_name(step)
            if not (target / SIDECAR).is_file():
                raise ArtifactError(f"{root / POINTER}: points to {target.name}, which is missing or incomplete")
            return target
    if _ITER_RE.match(path.name):
        raise ArtifactError(f"{path}: checkpoint is incomplete (no {SIDECAR}); it was interrupted while saving")
    raise ArtifactError(f"{path}: not a Tessera checkpoint (no {SIDECAR} and no {POINTER})")


def metadata_digest(directory: str | os.PathLike) -> tuple[str, str] | None:
    """(algorithm, digest) of `.metadata` the directory's sidecar records, for the safe DCP reader
    to check before it unpickles the index; None without one (read_sidecar reports a broken one)."""
    path = artifact_path(directory, SIDECAR)
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return str(data.get("checksum_algorithm", SHA256)), str(data["checksums"][METADATA_FILE])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def read_sidecar(directory: str | os.PathLike) -> CheckpointSidecar:
    directory = Path(directory)
    data: Any = read_json(artifact_path(directory, SIDECAR), "checkpoint sidecar")
    if not isinstance(data, dict) or data.get("format") != CHECKPOINT_FORMAT:
        raise ArtifactError(f"{directory / SIDECAR}: not a Tessera checkpoint sidecar")
    if data.get("format_version") not in SUPPORTED_FORMAT_VERSIONS:
        raise ArtifactError(f"{directory / SIDECAR}: checkpoint format version {data.get('format_version')} "
                            f"is not supported (this Tessera reads versions "
                            f"{', '.join(map(str, SUPPORTED_FORMAT_VERSIONS))}); upgrade Tessera")
    model = data.get("model")
    if isinstance(model, dict):  # the kind first: an unregistered one is refused by name
        model_kind(model.get("kind", DEFAULT_KIND), f"{directory / SIDECAR}: model.kind", ArtifactError)
    try:
        sidecar = CheckpointSidecar.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        raise ArtifactError(f"{directory / SIDECAR}: invalid sidecar: field {'.'.join(map(str, err['loc']))}: "
                            f"{err['msg']}") from None
    except Exception as exc:  # e.g. the kind's own refusal of a model that is not a mapping
        raise ArtifactError(f"{directory / SIDECAR}: invalid sidecar ({str(exc).splitlines()[0]})") from None
    if sidecar.checksum_algorithm not in CHECKSUM_ALGORITHMS:
        raise ArtifactError(f"{directory / SIDECAR}: checksum_algorithm {sidecar.checksum_algorithm!r} is not "
                            f"supported (known: {', '.join(CHECKSUM_ALGORITHMS)}); upgrade Tessera")
    return sidecar


def check_payload_listed(directory: str | os.PathLike, sidecar: CheckpointSidecar) -> None:
    """The sidecar's checksums list exactly the checkpoint's files (a save lists every file it
    wrote: finalize_checkpoint), and the table is not empty: no payload file goes unchecked."""
    directory = Path(directory)
    if not sidecar.checksums:
        raise ArtifactError(f"{directory / SIDECAR}: records no checksums, so its payload cannot be checked; "
                            "refusing the checkpoint (it was not written by a Tessera save, or was edited)")
    files = checkpoint_files(directory)
    missing = sorted(set(sidecar.checksums) - {p.name for p in files})
    if missing:
        raise ArtifactError(f"{directory / missing[0]}: checkpoint file missing (listed in the sidecar's checksums)")
    unlisted = [p.name for p in files if p.name not in sidecar.checksums]
    if unlisted:
        more = f" (and {len(unlisted) - 1} more)" if len(unlisted) > 1 else ""
        raise ArtifactError(f"{directory / unlisted[0]}: not listed in the sidecar's checksums{more}, so it "
                            "cannot be checked; the checkpoint was altered after it was saved (use the original)")


def verify_checksums(directory: str | os.PathLike, sidecar: CheckpointSidecar | None = None,
                     share: tuple[int, int] = (0, 1)) -> int:
    """Every payload file listed in the sidecar exists and matches its checksum (either algorithm).

    Files are hashed on threads (the hashers release the GIL: ~XXH3 speed per core). `share` =
    (index, count) checks only every count-th file from index, so `count` processes (the ranks of a
    resumed run) split the work. Returns the bytes checked."""
    from concurrent.futures import ThreadPoolExecutor

    directory = Path(directory)
    sidecar = sidecar or read_sidecar(directory)
    if sidecar.checksum_algorithm not in CHECKSUM_ALGORITHMS:
        raise ArtifactError(f"{directory / SIDECAR}: checksum_algorithm {sidecar.checksum_algorithm!r} is not "
                            f"supported (known: {', '.join(CHECKSUM_ALGORITHMS)})")
    check_payload_listed(directory, sidecar)
    index, count = share
    mine = sorted(sidecar.checksums.items())[index::count]
    for name, _ in mine:
        if not artifact_path(directory, name).is_file():
            raise ArtifactError(f"{directory / name}: checkpoint file missing")

    def check(item: tuple[str, str]) -> int:
        path = directory / item[0]
        if file_digest(path, sidecar.checksum_algorithm) != item[1]:
            raise ArtifactError(f"{path}: checksum mismatch; the checkpoint file is corrupt or truncated")
        return path.stat().st_size

    with ThreadPoolExecutor(max_workers=max(1, min(len(mine), os.cpu_count() or 1, 8))) as pool:
        return sum(pool.map(check, mine))


@contextlib.contextmanager
def single_process_dcp() -> Iterator[None]:
    """Silence DCP's warning that it 'assumes' a single process: with no_dist that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def model_tensor_specs(directory: str | os.PathLike) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """Name (without the `model.` prefix) -> (global shape, dtype) of every stored model tensor."""
    return _model_specs(read_dcp_metadata(Path(directory), metadata_digest(directory)))


def check_extents(directory: str | os.PathLike, metadata: Any) -> None:
    """Every payload file the DCP index names exists and holds its entries' bytes (stat only)."""
    directory = Path(directory)
    sizes: dict[str, int] = {}
    for index, info in metadata.storage_data.items():
        path = directory / info.relative_path
        if info.relative_path not in sizes:
            if not path.is_file():
                raise ArtifactError(f"{path}: checkpoint file missing (listed in .metadata)")
            sizes[info.relative_path] = path.stat().st_size
        if info.offset + info.length > sizes[info.relative_path]:
            raise ArtifactError(f"{path}: truncated ({index.fqn} ends at byte {info.offset + info.length}, "
                                f"the file has {sizes[info.relative_path]})")


def check_model_tensors(directory: str | os.PathLike, cfg: Any, metadata: Any) -> None:
    """The stored model tensors are exactly those of the model `cfg` describes (its kind's
    tensor_shapes): each one present with its shape and a float dtype weights may have
    (WEIGHT_DTYPES), none missing, none extra. Compared on the DCP index alone, before any tensor
    is allocated or read."""
    from tessera.common.hf.rules import WEIGHT_DTYPES

    where = Path(directory) / METADATA_FILE
    kind = kind_of(cfg)
    if kind.tensor_shapes is None:
        return  # a kind no stage reads yet: each stage refuses it by name before reading a tensor
    stored = _model_specs(metadata)
    names = [str(d).removeprefix("torch.") for d in WEIGHT_DTYPES]
    allowed = f"{', '.join(names[:-1])} or {names[-1]}"
    expected = kind.tensor_shapes(cfg)
    for name, shape in expected.items():
        if name not in stored:
            raise ArtifactError(f"{where}: model tensor {name!r} missing (the sidecar's model config has it)")
        have, dtype = stored[name]
        if tuple(have) != shape:
            raise ArtifactError(f"{where}: model tensor {name!r} has shape {list(have)}, the sidecar's model "
                                f"config implies {list(shape)}")
        if dtype not in WEIGHT_DTYPES:
            raise ArtifactError(f"{where}: model tensor {name!r} is stored as {str(dtype).removeprefix('torch.')}; "
                                f"model weights must be {allowed}")
    unknown = sorted(set(stored) - set(expected))
    if unknown:
        raise ArtifactError(f"{where}: model tensor {unknown[0]!r} is not part of the sidecar's model config "
                            f"({len(unknown)} such); the index and the sidecar do not belong together")


def check_checkpoint(directory: str | os.PathLike, sidecar: CheckpointSidecar | None = None) -> Any:
    """What every reader checks before allocating anything from a checkpoint (no payload byte is
    read): the DCP index is well formed and sized within its entries (safe_dcp), every entry lies
    inside its file, and the model tensors match the sidecar's model config. Returns the index.
    Checksums are separate (verify_checksums, or a converter's background check)."""
    directory = Path(directory)
    sidecar = sidecar or read_sidecar(directory)
    metadata = read_dcp_metadata(directory, metadata_digest(directory))
    check_extents(directory, metadata)
    check_model_tensors(directory, sidecar.model, metadata)
    return metadata


def _model_specs(metadata: Any) -> dict[str, tuple[torch.Size, torch.dtype]]:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    return {key[len(MODEL_PREFIX):]: (md.size, md.properties.dtype)
            for key, md in metadata.state_dict_metadata.items()
            if key.startswith(MODEL_PREFIX) and isinstance(md, TensorStorageMetadata)}


def load_model_tensors(directory: str | os.PathLike, names: list[str] | None = None) -> dict[str, torch.Tensor]:
    """Load model tensors (all, or `names`) as full tensors in one process, no process group needed.

    Reading a subset at a time keeps memory bounded for converters that stream tensor by tensor.
    """
    directory = Path(directory)
    specs = model_tensor_specs(directory)
    wanted = names if names is not None else list(specs)
    missing = [n for n in wanted if n not in specs]
    if missing:
        raise ArtifactError(f"{directory}: checkpoint has no tensor {missing[0]!r}")
    state = {MODEL_PREFIX + n: torch.empty(specs[n][0], dtype=specs[n][1]) for n in wanted}
    try:
        with single_process_dcp():
            dcp_load(state, directory, no_dist=True, expected_digest=metadata_digest(directory))
    except ArtifactError:
        raise
    except (Exception, CheckpointException) as exc:  # DCP's CheckpointException is a BaseException
        raise ArtifactError(f"{directory}: failed to read checkpoint tensors ({str(exc).splitlines()[0]}); "
                            "the checkpoint is corrupt or truncated") from None
    return {k[len(MODEL_PREFIX):]: v for k, v in state.items()}


def save_model_tensors(directory: str | os.PathLike, tensors: dict[str, torch.Tensor]) -> None:
    """Write model tensors as a single-process DCP checkpoint payload (no sidecar; see finalize)."""
    import torch.distributed.checkpoint as dcp

    with single_process_dcp():
        dcp.save({MODEL_PREFIX + k: v for k, v in tensors.items()}, checkpoint_id=str(directory), no_dist=True)
