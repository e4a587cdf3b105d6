"""The checkpoint manager: one object that saves and restores a run's stateful components.

    manager = CheckpointManager(root, cfg.checkpoint, tokenizer, sidecar, engine.components(), say)
    manager.start()                               # checkpoint.async_save: the background saver
    manager.save(train_state, background=False)   # the crash-safe sequence (storage.py)
    train_state = manager.load(directory)         # --resume: every component, from any layout
    manager.load_weights(directory)               # checkpoint.init_from: the model only

The components are the engine's (model, optimizer, loss scaler, RNG streams: one process or any
parallel layout, tessera.trainer.components.checkpoint.stateful) plus the data position (TrainState), which
storage writes with every save. The same rules for every layout:

* model and optimizer state load from a checkpoint of any layout (global tensors, layout-free
  names); optimizer state only when the checkpoint has it, the scaler only when it has one;
* RNG streams are per rank, so they are restored only under the layout they were saved from
  (else they stay as seeded, and a note says so: only dropout draws then differ);
* with checkpoint.async_save (`start`), saves asked for in the background overlap training: at
  most one in flight; the next save, `poll` and `finish` report it.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist

from tessera.common.checkpoint import CheckpointSidecar, check_checkpoint, read_sidecar, verify_checksums
from tessera.common.errors import ArtifactError
from tessera.common.tokenizer import Tokenizer
from tessera.trainer.components.checkpoint.stateful import Stateful, TrainState
from tessera.trainer.components.checkpoint.storage import (
    AsyncCheckpointer,
    restore,
    state_of,
    write_checkpoint,
)
from tessera.trainer.config import CheckpointConfig


class CheckpointManager:
    def __init__(self, root: Path, settings: CheckpointConfig, tokenizer: Tokenizer, sidecar: CheckpointSidecar,
                 components: dict[str, Stateful], say: Callable[[str], None]):
        self.root, self.settings = Path(root), settings
        self.keep_last, self.verify_on_load = settings.keep_last, settings.verify_on_load
        self.tokenizer, self.sidecar, self.layout = tokenizer, sidecar, sidecar.layout  # the layout this run runs
        self.components = components
        self.say = say
        self.async_saver: AsyncCheckpointer | None = None

    # ---- save ---------------------------------------------------------------------------------
    def start(self) -> None:
        """With checkpoint.async_save, start the background saver (a collective under torchrun: every
        rank calls it at the same point)."""
        if self.settings.async_save:
            self.async_saver = AsyncCheckpointer()

    def save(self, train_state: TrainState, background: bool = False) -> Path:
        """Save now; with `background` and checkpoint.async_save only the copy to CPU memory blocks.
        Collective under a process group (the state is gathered from every rank)."""
        saver = self.async_saver
        background = background and saver is not None
        if saver is not None:
            self._report(saver.wait())  # at most one in flight: the previous one completes first
        start = time.perf_counter()
        path = write_checkpoint(self.root, state_of(self.components), train_state, self.sidecar, self.tokenizer,
                                self.keep_last, saver if background else None)
        if background:
            self.say(f"saving checkpoint {path} in the background (state copied in {time.perf_counter() - start:.2f}s)")
        else:
            self.say(f"saved checkpoint {path} ({time.perf_counter() - start:.1f}s)")
        return path

    def poll(self) -> None:
        """Report a background save that finished since the last call (raises its error)."""
        if self.async_saver is not None:
            self._report(self.async_saver.poll())

    def _report(self, path: Path | None) -> None:
        if path is not None and self.async_saver is not None:
            self.say(f"saved checkpoint {path} (in the background, {self.async_saver.last_seconds:.1f}s)")

    def finish(self, failing: bool = False) -> None:
        """Let a save in flight complete (it is a good checkpoint) before the loop returns or raises;
        `failing`: the run is stopping on another error, so a failed save is noted, not raised."""
        if self.async_saver is None or not self.async_saver.in_flight:
            return
        unwinding = sys.exc_info()[0]  # called from `finally`: the exception unwinding, if any
        if unwinding is not None and issubclass(unwinding, KeyboardInterrupt):
            return  # a second Ctrl-C means now: the partial save is removed by the next run
        loop_failed = failing or unwinding is not None
        try:
            self._report(self.async_saver.wait())
        except Exception as exc:
            if not loop_failed:  # nothing else is failing: this is the error to report
                raise
            self.say(f"the background save failed as well: {exc}")

    # ---- load ---------------------------------------------------------------------------------
    def verify(self, directory: Path) -> None:
        """The payload's checksums against the sidecar before anything is read (checkpoint.verify_on_load):
        the ranks split the files, hash on threads, and all fail alike if any file is corrupt. The cost
        is printed."""
        start = time.perf_counter()
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        error, checked = None, 0
        try:
            checked = verify_checksums(directory, share=(rank, world))
        except ArtifactError as exc:
            error = str(exc)
        outcomes: list = [(error, checked)]
        if world > 1:
            outcomes = [None] * world
            dist.all_gather_object(outcomes, (error, checked))
        errors = [e for e, _ in outcomes if e is not None]
        if errors:
            raise ArtifactError(errors[0] + "; refusing to resume from it (an older checkpoint can be chosen by "
                                "editing the pointer file)")
        total = sum(n for _, n in outcomes)
        self.say(f"verified {directory.name}: {total / 2**20:.1f} MiB checksummed in "
                 f"{time.perf_counter() - start:.2f}s over {world} rank(s)")

    def load(self, directory: Path) -> TrainState:
        """Every component from a checkpoint of any layout (or of one process); the data position."""
        if self.verify_on_load:
            self.verify(directory)
        sidecar = read_sidecar(directory)
        check_checkpoint(directory, sidecar)  # index sizes, model tensors against the config: before reading
        saved_under = sidecar.layout.resolved(sidecar.model.num_layers)  # older sidecars leave the split implicit
        components = dict(self.components)
        if saved_under != self.layout and "rng" in components:
            del components["rng"]
            self.say(f"note: {directory} was saved under layout {saved_under.short()}; RNG streams re-seeded "
                     f"for {self.layout.short()} (only dropout draws differ from an uninterrupted run)")
        state = restore(directory, components)
        assert state is not None
        return state

    def load_weights(self, directory: Path) -> None:
        """Model tensors only, from a checkpoint of any layout (checkpoint.init_from): the optimizer,
        RNGs and data position stay fresh."""
        if self.verify_on_load:
            self.verify(directory)
        check_checkpoint(directory)
        restore(directory, {"model": self.components["model"]}, position=False)
