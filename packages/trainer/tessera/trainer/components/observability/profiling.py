"""Profiler traces of a window of training steps.

`StepProfiler` wraps the loop's steps: it starts torch.profiler before the first step of the
configured window and stops it after the last, then writes, per profiling rank,

    <profile_dir>/steps_<first>-<last>/rank<r>.trace.json.gz   Chrome trace (Perfetto, chrome://tracing)
    <profile_dir>/steps_<first>-<last>/rank<r>.ops.txt         operators by self time (device time on GPU)
    <profile_dir>/steps_<first>-<last>/rank<r>.memory_snapshot.pickle   CUDA allocator history (memory_snapshot)

both under temporary names renamed when whole. A run stopped inside the window (SIGTERM,
exit_after_steps) still writes what it profiled. Profiling is off unless profiling.start_step is
set, and costs nothing then.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from tessera.common.fileio import atomic_write_text, tmp_name
from tessera.trainer.config import ProfilingConfig

TOP_OPS = 40
# Allocator events kept for a memory snapshot (torchtitan and the PyTorch docs use 100k).
MEMORY_HISTORY_ENTRIES = 100_000


class StepProfiler:
    def __init__(self, cfg: ProfilingConfig, out_dir: Path, rank: int, device: torch.device,
                 say: Callable[[str], None]):
        self.cfg = cfg
        self.out_dir = out_dir
        self.rank = rank
        self.device = device
        self.say = say
        self.enabled = cfg.start_step is not None and (cfg.ranks is None or rank in cfg.ranks)
        self.first = cfg.start_step or 0
        self.last = self.first + cfg.num_steps - 1
        self._prof: profile | None = None
        self._window_start = 0
        self._last_profiled = 0
        self.memory_snapshot = cfg.memory_snapshot and device.type == "cuda"
        if self.enabled and cfg.memory_snapshot and not self.memory_snapshot:
            say("profiling.memory_snapshot records the CUDA allocator; this run is on CPU, so none is written")

    def before_step(self, step: int) -> None:
        """`step` is the number the step about to run will be logged with (1-based)."""
        if self.enabled and self._prof is None and self.first <= step <= self.last:
            activities = [ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(ProfilerActivity.CUDA)
            self._prof = profile(activities=activities, record_shapes=self.cfg.record_shapes,
                                 profile_memory=self.cfg.profile_memory, with_stack=self.cfg.with_stack)
            if self.memory_snapshot:
                torch.cuda.memory._record_memory_history(max_entries=MEMORY_HISTORY_ENTRIES)
            self._prof.start()
            self._window_start = step

    def after_step(self, step: int) -> None:
        if self._prof is None:
            return
        self._last_profiled = step
        if step >= self.last:
            self.finish()

    def finish(self) -> None:
        """Stop and write the traces (also for a window cut short by a stop); no-op when not profiling."""
        prof, self._prof = self._prof, None
        if prof is None:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        prof.stop()
        try:
            if self._last_profiled < self._window_start:  # stopped before a profiled step finished
                return
            self._write(prof)
        except OSError as exc:  # a diagnostic: training goes on without it
            self.say(f"note: could not write the profile of steps {self._window_start}-{self._last_profiled}: {exc}")
        finally:
            if self.memory_snapshot:
                torch.cuda.memory._record_memory_history(enabled=None)

    def _write(self, prof: profile) -> None:
        folder = self.out_dir / f"steps_{self._window_start:07d}-{self._last_profiled:07d}"
        folder.mkdir(parents=True, exist_ok=True)
        if self.memory_snapshot:
            snapshot = folder / f"rank{self.rank:05d}.memory_snapshot.pickle"
            partial = tmp_name(snapshot)
            try:
                torch.cuda.memory._dump_snapshot(str(partial))
                os.replace(partial, snapshot)
            finally:
                partial.unlink(missing_ok=True)
        trace = folder / f"rank{self.rank:05d}.trace.json.gz"
        # A temporary name that still ends in .gz: export_chrome_trace compresses by the suffix.
        partial = folder / f"{tmp_name(trace).name}.gz"
        try:
            prof.export_chrome_trace(str(partial))
            os.replace(partial, trace)
        finally:
            partial.unlink(missing_ok=True)
        sort_by = "self_device_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
        averages = prof.key_averages()
        atomic_write_text(folder / f"rank{self.rank:05d}.ops.txt",
                          averages.table(sort_by=sort_by, row_limit=TOP_OPS, max_name_column_width=80) + "\n",
                          sync=False)
        steps = self._last_profiled - self._window_start + 1
        self.say(f"profiled steps {self._window_start}-{self._last_profiled} on rank {self.rank}: {trace} "
                 f"(top by self time: {top_ops(averages, sort_by, steps)})")


def top_ops(averages, sort_by: str, steps: int, count: int = 3) -> str:
    """The `count` operators with the most self time, as 'name ms/step (share)'."""
    rows = sorted(averages, key=lambda e: getattr(e, sort_by), reverse=True)
    total = sum(getattr(e, sort_by) for e in averages) or 1.0
    return ", ".join(f"{e.key} {getattr(e, sort_by) / 1e3 / steps:.1f} ms/step ({100 * getattr(e, sort_by) / total:.0f}%)"
                     for e in rows[:count])
