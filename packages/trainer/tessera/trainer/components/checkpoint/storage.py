"""Saving and resuming the whole training state with torch.distributed.checkpoint (DCP).

State-dict layout (flattened by DCP with dots; every leaf is a tensor, so loading never unpickles):

    model.<param name>                          global tensors, plain-model names (the contract
                                                 in tessera.common.checkpoint)
    optimizer.state.<param name>.<key>          AdamW exp_avg / exp_avg_sq / step, keyed by the
                                                 parameter's name, not its position
    scaler.scale, scaler.growth_tracker          fp16 loss scaler (fp16 runs only)
    rng.torch_cpu, rng.torch_cuda, rng.numpy_*,  every RNG the run touches
    rng.python_state, rng.python_gauss
    train_state.step, .consumed_samples, .consumed_tokens

A parallel run (tessera.trainer.parallel.engine) writes the same `model.*`, `optimizer.*` and
`train_state.*` keys (global tensors, so any layout or one process reads them) and its RNG
streams per rank as `rng.rank<R>.*`. Each group of keys belongs to one stateful component
(tessera.trainer.components.checkpoint.stateful); `state_of` and `restore` save and load any set of them, and the
checkpoint manager (tessera.trainer.components.checkpoint.manager) decides which, for every layout.

The LR schedule is a pure function of train_state.step (tessera.trainer.components.optimizer.schedule), so the step is
its whole state. Hyper-parameters of the optimizer groups come from the config, not the file.

Reads go through two functions only: `stored_keys` (the DCP metadata) and `read_checkpoint`
(dcp.load into templates); nothing else here or in the parallel runtime reads a checkpoint.

Save sequence (a crash at any point leaves the previous checkpoint and the pointer intact):
write DCP files into `.iter_NNNNNNN.partial/`, write the sidecar there last (finalize), rename
to `iter_NNNNNNN/`, then replace the pointer file, then delete checkpoints beyond keep_last.
The temporary name is fixed (not per-process) so that every rank writes into the same directory.
With checkpoint.async_save the same sequence runs on a thread after DCP has copied the state to
CPU memory (AsyncCheckpointer).
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from tessera.common.checkpoint import (
    MODEL_PREFIX,
    SIDECAR,
    TOKENIZER_DIR,
    CheckpointSidecar,
    finalize_checkpoint,
    iter_dir_name,
    metadata_digest,
    read_pointer,
    read_sidecar,
    single_process_dcp,
    write_pointer,
)
from tessera.common.errors import ArtifactError
from tessera.common.faults import fault_point
from tessera.common.fileio import name_os_error, names_os_errors
from tessera.common.safe_dcp import dcp_load, read_dcp_metadata
from tessera.common.tokenizer import Tokenizer
from tessera.trainer.components.checkpoint.stateful import (
    ModuleState,
    OptimizerState,
    RNGState,
    ScalerState,
    Stateful,
    TrainState,
)
from tessera.trainer.components.precision.mixed import Precision

PARTIAL_SUFFIX = ".partial"
_ITER_RE = re.compile(r"^iter_(\d{7,})$")


# ---- save ---------------------------------------------------------------------------------------


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier(group: dist.ProcessGroup | None = None) -> None:
    if dist.is_initialized():
        dist.barrier(group=group)


def save_checkpoint(
    root: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    precision: Precision,
    train_state: TrainState,
    sidecar: CheckpointSidecar,
    tokenizer: Tokenizer,
    keep_last: int,
    background: AsyncCheckpointer | None = None,
) -> Path:
    """Write iter_<step>/ of a one-process model completely, then point the pointer at it."""
    return write_checkpoint(root, state_of(local_components(model, optimizer, precision)), train_state, sidecar,
                            tokenizer, keep_last, background)


def local_components(model: nn.Module, optimizer: torch.optim.Optimizer, precision: Precision) -> dict[str, Stateful]:
    """The stateful components of a one-process run (tessera.trainer.engine.LocalEngine's)."""
    components: dict[str, Stateful] = {"model": ModuleState(model), "optimizer": OptimizerState(optimizer),
                                       "rng": RNGState()}
    if precision.scaler is not None:
        components["scaler"] = ScalerState(precision)
    return components


def state_of(components: dict[str, Stateful]) -> dict:
    """One flat state dict (dotted keys) of every component, to save (collective under a process group)."""
    state: dict = {}
    for component in components.values():
        state.update(component.state_dict())
    return state


def write_checkpoint(
    root: Path,
    state: dict,
    train_state: TrainState,
    sidecar: CheckpointSidecar,
    tokenizer: Tokenizer,
    keep_last: int,
    background: AsyncCheckpointer | None = None,
) -> Path:
    """The save sequence for any state dict (nested, or flat with dotted keys; tensors or DTensors).

    Collective under a process group: every rank passes its part of the state; DCP stores
    each global tensor once. `train_state` is added here; rank 0 writes tokenizer, sidecar
    and pointer. With `background`, this returns once the state is copied to CPU memory and the
    rest happens on that checkpointer's thread (see AsyncCheckpointer)."""
    train_state = dataclasses.replace(train_state)  # a snapshot: the loop advances its own while a thread saves
    final, partial = _start_save(Path(root), train_state.step)
    state = {**state, "train_state": train_state.tensors()}
    job = _Finalize(Path(root), final, partial, sorted({key.split(".")[0] for key in state}), train_state,
                    sidecar, tokenizer, keep_last)
    if background is not None:
        background.start(state, job)
        fault_point("save.state_staged")
        return final
    with names_os_errors(partial), single_process_dcp():  # DCP's writes carry no file name: name the directory
        dcp.save(state, checkpoint_id=str(partial), no_dist=not dist.is_initialized())
    fault_point("save.payload_written")
    job.run()
    return final


def _start_save(root: Path, step: int) -> tuple[Path, Path]:
    """The final and temporary directory of the checkpoint for `step`, the latter created empty."""
    final = root / iter_dir_name(step)
    partial = root / f".{final.name}{PARTIAL_SUFFIX}"
    if _rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        _remove(partial)
        partial.mkdir()
        fault_point("save.partial_created")
    _barrier()
    return final, partial


@dataclass
class _Finalize:
    """What follows the DCP payload: rank 0 adds tokenizer and sidecar, renames, points, prunes."""

    root: Path
    final: Path
    partial: Path
    contents: list[str]
    train_state: TrainState
    sidecar: CheckpointSidecar
    tokenizer: Tokenizer
    keep_last: int

    def run(self, group: dist.ProcessGroup | None = None) -> None:
        _barrier(group)  # every rank's payload files are written
        error: BaseException | None = None
        if _rank() == 0:
            try:
                self._finish_on_rank_0()
            except BaseException as exc:
                name_os_error(exc, self.partial)
                error = exc
        # Instead of a bare barrier: every rank learns whether rank 0 finished, and fails alike if not.
        outcome = [None if error is None else f"{type(error).__name__}: {error}"]
        if dist.is_initialized():
            dist.broadcast_object_list(outcome, src=0, group=group)
        if error is not None:
            raise error
        if outcome[0] is not None:
            raise RuntimeError(f"rank 0 could not finish {self.final.name}: {outcome[0]}")

    def _finish_on_rank_0(self) -> None:
        self.tokenizer.save(self.partial / TOKENIZER_DIR)
        fault_point("save.tokenizer_written")
        sidecar = self.sidecar.model_copy()
        sidecar.step = self.train_state.step
        sidecar.consumed_samples = self.train_state.consumed_samples
        sidecar.consumed_tokens = self.train_state.consumed_tokens
        sidecar.contents = self.contents
        finalize_checkpoint(self.partial, sidecar)  # sidecar last: marks the directory complete
        fault_point("save.sidecar_written")
        if os.path.lexists(self.final):  # a stale checkpoint of the same step (e.g. from a run that was rewound)
            _remove(self.final)
            fault_point("save.stale_removed")
        os.replace(self.partial, self.final)
        _fsync_dir(self.root)
        fault_point("save.renamed")
        write_pointer(self.root, self.train_state.step)
        fault_point("save.pointer_written")
        prune_checkpoints(self.root, self.keep_last)
        fault_point("save.pruned")


class AsyncCheckpointer:
    """checkpoint.async_save: saves that overlap training (Megatron's --async-save).

    `start` returns once DCP's async_save has copied the state into CPU memory (so training may
    change the parameters at once); a thread then writes the payload and finalizes exactly like a
    synchronous save: same files, same crash safety (the pointer moves only when the checkpoint is
    whole). At most one save is in flight: the next `start` (or `wait`) waits for the previous.
    Under torchrun the thread's collectives run on a gloo group of their own, created here (a
    collective: every rank builds its AsyncCheckpointer at the same point), so they never
    interleave with the training's. A failed write is raised by the next `wait`/`poll`.
    """

    def __init__(self) -> None:
        self.group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        if self.group is None:
            # DCP warns on its writer thread (out of single_process_dcp's reach) that it assumes one
            # process: that is the intent here.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._job: _Finalize | None = None
        self._started = 0.0
        self._seconds = 0.0

    def start(self, state: dict, job: _Finalize) -> None:
        self.wait()
        self._started = time.perf_counter()
        with single_process_dcp():
            future = dcp.async_save(state, checkpoint_id=str(job.partial), process_group=self.group,
                                    no_dist=not dist.is_initialized())
        self._job = job
        # A daemon: a second Ctrl-C must be able to end the process mid-save (the next run removes the
        # partial directory); every normal path joins it.
        self._thread = threading.Thread(target=self._finish, args=(future, job), name="tessera-async-save",
                                        daemon=True)
        self._thread.start()

    def _finish(self, future: Any, job: _Finalize) -> None:
        error: BaseException | None = None
        try:
            future.result()
            fault_point("save.payload_written")
        except BaseException as exc:  # reported to the training thread by wait()/poll()
            name_os_error(exc, job.partial)
            error = exc
        try:
            if not _all_ranks_ok(error is None, self.group):
                raise error or RuntimeError(f"another rank failed to write its part of {job.final.name}")
            job.run(self.group)
        except BaseException as exc:
            self._error = exc
        self._seconds = time.perf_counter() - self._started

    @property
    def in_flight(self) -> bool:
        return self._thread is not None

    def poll(self) -> Path | None:
        """The checkpoint that finished since the last call (None while writing or idle); raises its error."""
        if self._thread is None or self._thread.is_alive():
            return None
        return self.wait()

    def wait(self) -> Path | None:
        """Block until the save in flight is complete; return its directory (None if none); raise its error."""
        if self._thread is None:
            return None
        self._thread.join()
        self._thread = None
        job, self._job = self._job, None
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"background save of {job.final if job else 'a checkpoint'} failed: {error}") from error
        return job.final if job else None

    @property
    def last_seconds(self) -> float:
        """Wall time of the last finished save, from start to pointer."""
        return self._seconds


def _all_ranks_ok(ok: bool, group: dist.ProcessGroup | None) -> bool:
    if not dist.is_initialized():
        return ok
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def list_checkpoints(root: Path) -> list[int]:
    """Steps of the complete checkpoints (with a sidecar) under root, ascending."""
    if not root.is_dir():
        return []
    steps = []
    for p in root.iterdir():
        m = _ITER_RE.match(p.name)
        if m and (p / SIDECAR).is_file():
            steps.append(int(m.group(1)))
    return sorted(steps)


def prune_checkpoints(root: Path, keep_last: int) -> None:
    """Delete all but the newest keep_last complete checkpoints (never the one the pointer names)."""
    pointed = read_pointer(root)
    steps = list_checkpoints(root)
    for step in steps[:-keep_last]:
        if step != pointed:
            shutil.rmtree(root / iter_dir_name(step), ignore_errors=True)


def remove_partial_saves(root: Path) -> list[Path]:
    """Remove leftovers of saves that were interrupted (never complete, never pointed to)."""
    removed = []
    if root.is_dir():
        for p in root.iterdir():
            if p.name.startswith(".iter_") and p.name.endswith(PARTIAL_SUFFIX):
                _remove(p)
                removed.append(p)
    return removed


def _remove(path: Path) -> None:
    """Remove what lies under one of the save's own names, never following a link: a symbolic link
    (or a file) there is unlinked and its target left alone, so a save always writes into a fresh
    directory of its own instead of through a link or failing on it (FileExistsError before)."""
    if path.is_symlink() or (os.path.lexists(path) and not path.is_dir()):
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path, ignore_errors=True)  # it unlinks the links inside a directory, never follows them


# ---- load ---------------------------------------------------------------------------------------


def latest_checkpoint(root: Path) -> Path | None:
    step = read_pointer(root)
    if step is None:
        return None
    directory = Path(root) / iter_dir_name(step)
    if not (directory / SIDECAR).is_file():
        raise ArtifactError(f"{Path(root) / 'latest_checkpointed_iteration.txt'}: points to {directory.name}, "
                            "which is missing or incomplete; fix the pointer or delete it to start over")
    return directory


def stored_keys(directory: Path) -> set[str]:
    """Flat names of every tensor in a DCP checkpoint (e.g. 'model.norm.weight')."""
    return set(read_dcp_metadata(directory, metadata_digest(directory)).state_dict_metadata)


def read_checkpoint(directory: Path, state: dict) -> None:
    """Fill `state` (templates of the right shapes and placements) from the checkpoint, in place."""
    try:
        with single_process_dcp():
            dcp_load(state, directory, no_dist=not dist.is_initialized(), expected_digest=metadata_digest(directory))
    except ArtifactError:
        raise
    except (Exception, CheckpointException) as exc:  # DCP's CheckpointException is a BaseException
        raise ArtifactError(f"{directory}: cannot restore training state ({str(exc).splitlines()[0][:200]}); "
                            "was it written by a different model or precision?") from None


def restore(directory: Path, components: dict[str, Stateful], position: bool = True) -> TrainState | None:
    """Restore the components from `directory` (each takes what the checkpoint holds of it) and,
    with `position`, return the data position it was saved at. Collective under a process group."""
    stored = stored_keys(directory)
    templates = {name: c.load_template(stored) for name, c in components.items()}
    state = {k: v for t in templates.values() for k, v in t.items()}
    counters = {f"train_state.{k}": v for k, v in TrainState().tensors().items()} if position else {}
    state.update(counters)
    read_checkpoint(directory, state)
    for name, component in components.items():
        if templates[name]:
            component.load_state_dict({k: state[k] for k in templates[name]})
    return TrainState.from_tensors({k.removeprefix("train_state."): state[k] for k in counters}) if position else None


def load_checkpoint(
    directory: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    precision: Precision,
) -> tuple[TrainState, CheckpointSidecar]:
    """Restore a one-process model, optimizer, scaler and RNG states in place; return the train state
    and sidecar (RNG states only when the checkpoint holds this process's kind of them)."""
    sidecar = read_sidecar(directory)
    return restore(directory, local_components(model, optimizer, precision)), sidecar


__all__ = ["MODEL_PREFIX", "TrainState", "AsyncCheckpointer", "save_checkpoint", "load_checkpoint", "write_checkpoint",
           "read_checkpoint", "restore", "state_of", "local_components", "stored_keys", "latest_checkpoint",
           "list_checkpoints", "prune_checkpoints", "remove_partial_saves"]
