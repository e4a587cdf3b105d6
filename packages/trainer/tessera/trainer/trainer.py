"""The training loop: small components, each built from its config section, wired by one trainer.

`check_inputs` (tessera.trainer.inputs) has checked the config against the files, the world size
and the machine (one line, exit 2). `Trainer.__init__` then builds

    engine       model, optimizer, precision and step for the layout (training, parallel, optim):
                 `LocalEngine` for one plain process, `ParallelEngine` (tessera.trainer.parallel) else
    schedule     the learning rate per step (schedule, optim)
    data         the train, valid and test batches of the mixture (data, training)
    sink         console, metrics.jsonl, TensorBoard, trackers (logging)
    checkpoints  the checkpoint manager over the engine's stateful components (checkpoint)

and `Trainer.train` runs optimizer steps over them: the engine's step on this rank's rows of each
global batch, logging, evaluation, checkpointing, and a graceful stop on SIGTERM/SIGINT. The loop
is one for every layout; what depends on the layout is the engine's (tessera.trainer.engine).
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml
from tqdm import tqdm

from tessera.common.checkpoint import CheckpointSidecar, read_sidecar
from tessera.common.errors import RunError, out_of_memory
from tessera.common.faults import fault_point
from tessera.common.fileio import atomic_write_text
from tessera.common.layers.sdpa_backend import sdpa_backend
from tessera.common.mixture import MixtureManifest, MixtureSplit
from tessera.common.models.registry import kind_of
from tessera.trainer.components.checkpoint.manager import CheckpointManager
from tessera.trainer.components.checkpoint.stateful import TrainState
from tessera.trainer.components.checkpoint.storage import latest_checkpoint, remove_partial_saves
from tessera.trainer.components.distributed import Runtime
from tessera.trainer.components.observability.host_memory import retain_freed_memory
from tessera.trainer.components.observability.metrics import (
    MetricsSink,
    memory_gib,
    resolve_peak_tflops,
    step_time_spread,
)
from tessera.trainer.components.observability.out_of_memory import AFTER_STEP, STEP, out_of_memory_error
from tessera.trainer.components.observability.profiling import StepProfiler
from tessera.trainer.components.observability.signals import StopRequest
from tessera.trainer.components.observability.watchdog import StepWatchdog
from tessera.trainer.components.optimizer.schedule import LRSchedule
from tessera.trainer.config import DataConfig, TrainConfig, TrainingConfig
from tessera.trainer.engine import Engine, LocalEngine
from tessera.trainer.inputs import CheckedInputs
from tessera.trainer.objectives.batches import MicroBatchPlan, MixtureBatches, global_batch_size_at
from tessera.trainer.objectives.documents import DocumentMasking
from tessera.trainer.objectives.registry import batch_builder
from tessera.trainer.parallel.engine import ParallelEngine


def eval_record(loss: float, split: str = "valid") -> dict[str, float]:
    return {f"{split}_loss": loss, f"{split}_ppl": math.exp(min(loss, 50.0))}


@dataclass
class RunData:
    """The splits a run reads: train; valid and test when it evaluates (training.eval_interval or
    eval_only), test only when the mixture has samples in it (evaluated once, at the end)."""

    train: MixtureBatches
    valid: MixtureBatches | None = None
    test: MixtureBatches | None = None

    @classmethod
    def open(cls, data: DataConfig, training: TrainingConfig, manifest: MixtureManifest,
             documents: DocumentMasking | None, batches: type[MixtureBatches] = MixtureBatches) -> RunData:
        """Each split read through `batches`, the model kind's batch builder (tessera.trainer.kinds)."""
        def split(name: str) -> MixtureBatches:
            return batches(MixtureSplit(data.mixture, name, data.check_fingerprints), training.seq_length, documents)

        evaluating = bool(training.eval_interval or training.eval_only)
        train = split(data.train_split)
        valid = split(data.valid_split) if evaluating and data.valid_split else None
        test = manifest.splits.get(data.test_split) if data.test_split else None
        return cls(train, valid, split(data.test_split) if evaluating and test is not None and test.num_samples > 0
                   else None)


def build_engine(cfg: TrainConfig, inputs: CheckedInputs, runtime: Runtime) -> Engine:
    """The execution engine for the run's layout: one plain process, or the parallel runtime."""
    if inputs.parallel:
        return ParallelEngine(inputs.model, inputs.layout, cfg.training, cfg.parallel, cfg.optim, inputs.documents,
                              runtime.device)
    return LocalEngine(inputs.model, cfg.training, cfg.optim, inputs.documents, runtime.device)


class Trainer:
    """The training loop, the same under every layout; the layout is the engine's business."""

    def __init__(self, cfg: TrainConfig, inputs: CheckedInputs, runtime: Runtime, quiet: bool = False,
                 engine: Engine | None = None):
        self.cfg, self.inputs, self.rt, self.quiet = cfg, inputs, runtime, quiet
        t = cfg.training
        if runtime.device.type == "cpu":  # this process's settings, before anything is allocated
            if t.threads is not None:
                torch.set_num_threads(t.threads)
            if t.retain_host_memory:
                retain_freed_memory()
        # The model kind's batch builder, before the model is built: its one-line refusals come first.
        self.data = RunData.open(cfg.data, t, inputs.manifest, inputs.documents, batch_builder(cfg, inputs))
        self.engine = engine if engine is not None else build_engine(cfg, inputs, runtime)
        self.schedule = LRSchedule(cfg.schedule, cfg.optim, t.steps)
        self.state = TrainState()
        self.sink = MetricsSink.for_run(cfg.logging, cfg.run_dir, cfg.model_dump(mode="json"), self.say,
                                        runtime.is_main)
        self.started = time.monotonic()  # training.exit_after_minutes counts from here
        # The model's generation settings (end ids, sampling defaults: tessera.common.hf.generation)
        # pass from the checkpoint it starts from to its own, so an imported model keeps them.
        source = inputs.resume_from or inputs.init_from
        sidecar = CheckpointSidecar(model=inputs.model, tokenizer_fingerprint=inputs.tokenizer.fingerprint,
                                    layout=inputs.layout, mixture_fingerprint=inputs.mixture_fingerprint,
                                    generation=read_sidecar(source).generation if source is not None else None,
                                    params_dtype="float32", precision=t.precision,
                                    # consumed_samples counts rows of this length when packed (inputs.py)
                                    packed_seq_length=t.seq_length if cfg.data.pack_samples else None)
        self.checkpoints = CheckpointManager(cfg.checkpoint_dir, cfg.checkpoint, inputs.tokenizer, sidecar,
                                             self.engine.components(), self.say)
        # The loop's own bookkeeping.
        self.plan = self._plan(t.global_batch_size)  # the full global batch (evaluation's)
        self.last_step_samples = t.global_batch_size  # global batch of the latest step
        self.router_metrics: dict[str, float] = {}  # MoE router statistics of the last step
        self.flops_per_token = kind_of(inputs.model).flops_per_token(inputs.model, t.seq_length)
        self.peak_tflops: float | None = None
        self.phase, self.compiling = "setting up", False  # what an out-of-memory line names

    # ---- output ------------------------------------------------------------------------------
    def say(self, line: str) -> None:
        if self.rt.is_main:
            tqdm.write(line, file=sys.stdout)
            sys.stdout.flush()

    def say_any_rank(self, line: str) -> None:
        """For lines about this rank only (e.g. its profiler trace), printed by whichever rank has them."""
        prefix = f"[rank {self.rt.rank}] " if self.rt.world_size > 1 else ""
        tqdm.write(prefix + line, file=sys.stdout)
        sys.stdout.flush()

    # ---- steps -------------------------------------------------------------------------------
    def _plan(self, batch: int) -> MicroBatchPlan:
        return MicroBatchPlan(batch, self.cfg.training.micro_batch_size, self.engine.dp_rank, self.engine.dp_size)

    def plan_at(self, consumed_samples: int) -> MicroBatchPlan:
        """The micro-batch plan of the step starting at `consumed_samples` (training.rampup_batch_size)."""
        t = self.cfg.training
        return self._plan(global_batch_size_at(consumed_samples, t.global_batch_size, t.rampup_batch_size))

    def train_step(self) -> tuple[float, float, bool]:
        """One optimizer step over a global batch; returns (mean loss, grad norm, step taken)."""
        self.engine.set_lr(self.schedule(self.state.step))
        plan = self.plan_at(self.state.consumed_samples)
        batch = self.data.train.batch(plan.rank_sample_ids(self.state.consumed_samples))
        with sdpa_backend(self.cfg.training.attention_backend):
            result = self.engine.train_step(*batch)
        self.router_metrics = result.router
        self.advance()  # a skipped step (fp16 overflow) still consumes its data
        return result.loss, result.grad_norm, result.stepped

    def advance(self) -> None:
        """Count a finished step and the data it consumed (the whole data position)."""
        t = self.cfg.training
        batch = global_batch_size_at(self.state.consumed_samples, t.global_batch_size, t.rampup_batch_size)
        self.state.step += 1
        self.state.consumed_samples += batch
        self.state.consumed_tokens += batch * t.seq_length
        self.last_step_samples = batch

    def evaluate(self, data: MixtureBatches | None = None) -> float:
        """Mean token loss over the first eval_iters global batches of `data` (default: the valid split):
        the same samples every time and under every layout (data-parallel ranks take their rows of
        each batch, as in training); batches weighted by their counted tokens (equal without
        data.eod_mask_loss), so the result is the mean over every counted token."""
        data = data if data is not None else self.data.valid
        assert data is not None
        t = self.cfg.training
        total, counted = 0.0, 0
        for i in range(t.eval_iters):
            batch = data.batch(self.plan.rank_sample_ids(i * t.global_batch_size))
            with sdpa_backend(t.attention_backend):
                loss, tokens = self.engine.eval_batch(*batch)
            total += loss * tokens
            counted += tokens
        return total / max(counted, 1)

    def params_norm(self) -> float:
        """Global L2 norm of the parameters (logging.params_norm; a collective under torchrun)."""
        return self.engine.params_norm()

    # ---- checkpoints -------------------------------------------------------------------------
    def save(self, background: bool = False) -> Path:
        return self.checkpoints.save(self.state, background)

    def load(self, directory: Path) -> None:
        self.state = self.checkpoints.load(directory)

    # ---- the loop ----------------------------------------------------------------------------
    def start(self) -> None:
        """Before the first step: the run directory, the RNGs, the state to resume from (or the
        weights to start from), one line about the run and the MFU reference."""
        cfg, t = self.cfg, self.cfg.training
        if self.rt.is_main and not t.eval_only:  # an evaluation leaves the training run's config.yaml alone
            cfg.run_dir.mkdir(parents=True, exist_ok=True)
            atomic_write_text(cfg.run_dir / "config.yaml", yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
            for stale in remove_partial_saves(cfg.checkpoint_dir):
                self.say(f"removed {stale} (left by a save that was interrupted)")
        # Seeded after the model is built (init does not shift the dropout stream); on resume for the
        # RNGs the checkpoint does not restore.
        self.engine.seed(t.seed)
        if self.inputs.resume_from is not None:
            self.phase = "loading the checkpoint"
            self.load(self.inputs.resume_from)
            self.say(f"resumed from {self.inputs.resume_from} at step {self.state.step} "
                     f"({self.state.consumed_samples} samples consumed)")
        elif self.inputs.init_from is not None:
            self.checkpoints.load_weights(self.inputs.init_from)
            self.say(f"initialized the model from {self.inputs.init_from} (step "
                     f"{read_sidecar(self.inputs.init_from).step} of that run); optimizer, schedule and data "
                     "start at step 0")
        n_params = self.inputs.model.num_params()
        self.say(f"model: {n_params / 1e6:.2f}M parameters, {self.flops_per_token / 1e6:.1f} MFLOP/token at "
                 f"seq {t.seq_length}; {self.plan.num_micro_batches} micro-batch(es) of {t.micro_batch_size} x "
                 f"{self.inputs.layout.data} data-parallel"
                 + (f" x {self.inputs.layout.expert} expert-parallel" if self.inputs.layout.expert > 1 else "")
                 + " rank(s) per step"
                 + (f" (ramping up from global batch {t.rampup_batch_size[0]} by {t.rampup_batch_size[1]} over "
                    f"{t.rampup_batch_size[2]} samples)" if t.rampup_batch_size else "")
                 + f"; layout {self.inputs.layout.short()}; "
                 f"precision {t.precision}; device {self.rt.device}")
        self.peak_tflops, peak_source = resolve_peak_tflops(self.rt.device, t.peak_tflops)
        self.peak_estimated = peak_source.startswith("measured")  # CPU: raised to the best seen (observability/metrics.py)
        if self.peak_tflops is not None:
            self.say(f"MFU reference: {self.peak_tflops:.3f} TFLOP/s ({peak_source})")

    def train(self) -> TrainState:
        """Run the loop; running out of memory anywhere in it is one line naming what to change."""
        try:
            return self._train()
        except BaseException as exc:
            oom = out_of_memory(exc)
            if oom is None or isinstance(exc, RunError):
                raise
            raise self.out_of_memory(oom) from None

    def out_of_memory(self, oom: BaseException) -> RunError:
        self.checkpoints.finish(failing=True)  # a save in flight is of an earlier step: let it land
        step = self.state.step + (1 if self.phase == STEP else 0)
        return out_of_memory_error(oom, self.cfg, self.inputs.layout, self.phase, step, self.rt.rank, self.rt.is_main,
                                   self.rt.device, latest_checkpoint(self.cfg.checkpoint_dir), self.compiling)

    def _train(self) -> TrainState:
        cfg, t = self.cfg, self.cfg.training
        self.start()
        if t.eval_only:
            self.phase = "evaluation"
            return self.evaluate_only()
        if self.state.step >= t.steps:
            self.say(f"nothing to do: already at step {self.state.step} of {t.steps}")
            self.sink.close()
            return self.state

        self.checkpoints.start()  # checkpoint.async_save: a collective under torchrun, same point on every rank
        stop = StopRequest().install()
        show_bar = self.rt.is_main and not self.quiet and sys.stderr.isatty()
        bar = tqdm(total=t.steps, initial=self.state.step, disable=not show_bar, unit="step", dynamic_ncols=True)
        profiler = StepProfiler(cfg.profiling, cfg.profile_dir, self.rt.rank, self.rt.device, self.say_any_rank)
        last_saved = -1
        exit_at = self.state.step + t.exit_after_steps if t.exit_after_steps else None
        watchdog, first_step = StepWatchdog(t.step_timeout_minutes, self.rt.rank), self.state.step
        try:
            # Steps, their wall time and their samples since the last log line.
            window_steps, window_time, window_samples = 0, 0.0, 0
            compiling = t.compile
            while self.state.step < t.steps:
                # Step N+1 from here (its hooks included) until it returns: an error after that is
                # step N's, and not its forward (AFTER_STEP), nor the previous save.
                self.phase, self.compiling = STEP, compiling
                if self.state.step > first_step:  # armed after the first step, which may compile
                    watchdog.beat(f"in step {self.state.step + 1}")
                fault_point("train.step")
                profiler.before_step(self.state.step + 1)
                step_start = time.perf_counter()
                loss, grad_norm, stepped = self.train_step()
                self.phase, self.compiling = AFTER_STEP, False
                step_time = time.perf_counter() - step_start
                profiler.after_step(self.state.step)
                if compiling:  # the first step compiles: report it, keep it out of throughput
                    self.say(f"first step (includes torch.compile): {step_time:.1f}s")
                    compiling = False
                else:
                    window_steps, window_time = window_steps + 1, window_time + step_time
                    window_samples += self.last_step_samples
                bar.update(1)
                if t.check_nonfinite and t.precision != "fp16" and not (math.isfinite(loss) and math.isfinite(grad_norm)):
                    self._log_train(loss, grad_norm, stepped, window_samples or self.last_step_samples,
                                    window_time or step_time, max(window_steps, 1))
                    raise self._diverged(loss, grad_norm)
                if not stepped:
                    self.say(f"step {self.state.step}: fp16 gradients overflowed; step skipped, "
                             f"loss scale lowered to {self.engine.loss_scale:g}")
                if self.state.step % t.log_interval == 0 or self.state.step == t.steps:
                    if window_steps == 0:
                        window_steps, window_time, window_samples = 1, step_time, self.last_step_samples
                    self._log_train(loss, grad_norm, stepped, window_samples, window_time, window_steps)
                    bar.set_postfix(loss=f"{loss:.3f}")
                    window_steps, window_time, window_samples = 0, 0.0, 0
                if self.data.valid is not None and (self.state.step % t.eval_interval == 0 or self.state.step == t.steps):
                    watchdog.beat(f"evaluating at step {self.state.step}")
                    self.phase = "evaluation"
                    self.sink.log({"kind": "eval", "step": self.state.step, **eval_record(self.evaluate())})
                if self.data.test is not None and self.state.step == t.steps:
                    self.phase = "evaluation"
                    self.sink.log({"kind": "test", "step": self.state.step,
                                   **eval_record(self.evaluate(self.data.test), "test")})
                time_up = (t.exit_after_minutes is not None
                           and time.monotonic() - self.started >= 60 * t.exit_after_minutes)
                stop_now = self._agree_on_stop(stop.requested or time_up) or self.state.step == exit_at
                self.phase = "checkpoint save"
                self.checkpoints.poll()
                last_step = self.state.step == t.steps or stop_now
                if (t.save_interval and self.state.step % t.save_interval == 0) or last_step:
                    watchdog.beat(f"saving step {self.state.step}")
                    self.save(background=not last_step)  # in the background with checkpoint.async_save
                    last_saved = self.state.step
                if stop_now:
                    if stop.requested:
                        reason = f"received {stop.signal_name}"
                    elif self.state.step == exit_at:
                        reason = f"training.exit_after_steps={t.exit_after_steps} reached"
                    elif time_up:
                        reason = f"training.exit_after_minutes={t.exit_after_minutes:g} reached"
                    else:  # the signal or time limit reached another rank first
                        reason = "another rank was asked to stop"
                    self.say(f"{reason}: saved at step {self.state.step}, exiting")
                    break
        finally:
            watchdog.stop()
            try:
                profiler.finish()  # a window cut short by a stop still writes what it recorded
                self.checkpoints.finish()
            finally:
                bar.close()
                stop.restore(after_stop=True)
                self.sink.close()
        assert last_saved == self.state.step
        return self.state

    def evaluate_only(self) -> TrainState:
        """training.eval_only: log the valid and test losses of the loaded model at its step; nothing else."""
        assert self.data.valid is not None or self.data.test is not None  # check_inputs made sure
        if self.data.valid is not None:
            self.sink.log({"kind": "eval", "step": self.state.step, **eval_record(self.evaluate())})
        if self.data.test is not None:
            self.sink.log({"kind": "test", "step": self.state.step, **eval_record(self.evaluate(self.data.test), "test")})
        self.sink.close()
        return self.state

    def _diverged(self, loss: float, grad_norm: float) -> RunError:
        """The error for a non-finite step: nothing is saved, so the newest checkpoint is the last good one."""
        self.checkpoints.finish(failing=True)  # a save in flight is of an earlier, good step: let it land
        newest = latest_checkpoint(self.cfg.checkpoint_dir)
        where = f"the newest checkpoint is {newest}" if newest is not None else "no checkpoint was saved yet"
        first = self.state.consumed_samples - self.last_step_samples
        return RunError(f"step {self.state.step}: loss {loss:.6g}, gradient norm {grad_norm:.6g} (not finite); stopped "
                        f"without saving, {where}. Lower optim.lr or raise schedule.warmup_steps, or look at this "
                        f"step's batch (samples {first}-{self.state.consumed_samples - 1} of the mixture's "
                        f"{self.cfg.data.train_split} split); then --resume "
                        "(training.check_nonfinite=false trains on regardless)")

    def _log_train(self, loss: float, grad_norm: float, stepped: bool, samples: int, seconds: float,
                   steps: int = 1) -> None:
        """Throughput over the `steps` training steps (`samples` sequences) since the last log line
        (evaluation and saving excluded)."""
        t = self.cfg.training
        tokens_per_s = samples * t.seq_length / max(seconds, 1e-9)
        tflops = tokens_per_s * self.flops_per_token / 1e12
        if self.peak_tflops and self.peak_estimated:
            self.peak_tflops = max(self.peak_tflops, tflops / self.rt.world_size)
        spread = step_time_spread(seconds / steps, self.rt.world_size, self.rt.device)
        self.sink.log({
            "kind": "train", "step": self.state.step, "total_steps": t.steps, "loss": loss,
            "grad_norm": grad_norm, "lr": self.engine.lr,
            "tokens_per_s": tokens_per_s, "tflops": tflops,
            "mfu": tflops / (self.peak_tflops * self.rt.world_size) if self.peak_tflops else None,
            **({"mfu_estimate": True} if self.peak_estimated else {}), **spread,
            "memory_gib": memory_gib(self.rt.device), "loss_scale": self.engine.loss_scale,
            "step_skipped": not stepped, "consumed_samples": self.state.consumed_samples,
            "consumed_tokens": self.state.consumed_tokens, "step_time_s": seconds / steps,
            "global_batch_size": self.last_step_samples,
            **({"params_norm": self.params_norm()} if self.cfg.logging.params_norm else {}),
            **self.router_metrics,
        })

    def _agree_on_stop(self, local: bool) -> bool:
        """All ranks stop together (a signal may reach only some of them)."""
        return self.engine.any_rank(local)
