"""Out of memory in a training run, as one line that says what to change.

torch's OutOfMemoryError (or the CPU allocator's RuntimeError) reached the user as a traceback from
every rank. The trainer turns it into a RunError (one line, exit 1, through
tessera.common.errors.run_cli): the step and the phase it happened in, what was asked and what was
free, the layout and micro-batch, and the settings of this config that would lower the memory of
that phase. Nothing is saved on the way out: a save interrupted by it never reaches the pointer
(checkpoint/storage.py writes it last), so the newest checkpoint is the last whole one.

The phase inside a step comes from the error's traceback: the innermost frame of torch's
optimizers (or ours) means the optimizer step, of autograd's backward the backward (recompute's
second forward included), else the forward. torch.compile's frames run in every compiled step,
so a compiling first step is told by the loop, not by them.
"""

from __future__ import annotations

import traceback
from pathlib import Path

from tessera.common.errors import RunError, describe_out_of_memory
from tessera.trainer.config import TrainConfig

STEP = "step"  # the loop's phase while it runs a training step; refined from the traceback
AFTER_STEP = "after the step"  # its logging and profiler hooks: neither activations nor the state's memory
_OPTIMIZER_FILES = ("/torch/optim/", "/trainer/components/optimizer/", "/trainer/parallel/optimizer.py",
                    "/trainer/parallel/fsdp.py")
_ACTIVATION_PHASES = ("forward", "backward", "evaluation")


def step_phase(oom: BaseException) -> str:
    """forward, backward or optimizer step, from the innermost frame that tells."""
    for frame in reversed(traceback.extract_tb(oom.__traceback__)):
        path = frame.filename.replace("\\", "/")
        if any(part in path for part in _OPTIMIZER_FILES):
            return "optimizer step"
        if frame.name in ("backward", "_engine_run_backward") and ("/torch/autograd/" in path
                                                                 or path.endswith("/torch/_tensor.py")):
            return "backward"
    return "forward"


def levers(cfg: TrainConfig, layout, phase: str, device_type: str) -> list[str]:
    """The settings of this config that lower the memory of `phase`, each with its value now."""
    t, p = cfg.training, cfg.parallel
    out: list[str] = []
    if phase in _ACTIVATION_PHASES:
        if t.micro_batch_size > 1:
            # Its largest proper divisor: whatever the global batch (and a ramp-up's sizes) was a
            # multiple of stays one (half of an odd size would be refused by the next run).
            smaller = max(d for d in range(1, t.micro_batch_size) if t.micro_batch_size % d == 0)
            out.append(f"training.micro_batch_size={smaller} (now {t.micro_batch_size}; "
                       f"the global batch of {t.global_batch_size} is kept by accumulating more micro-batches)")
        if phase != "evaluation" and t.recompute != "full" and not (t.precision == "fp8" and t.fp8_backend == "te"):
            out.append(f"training.recompute={'selective' if t.recompute == 'none' else 'full'} (now {t.recompute})")
        if t.loss_chunk_tokens is None:
            out.append("training.loss_chunk_tokens=4096 (the full-vocabulary logits of a micro-batch never exist at "
                       "once)")
        out.append(f"a shorter training.seq_length (now {t.seq_length})")
        if t.precision == "fp32":
            out.append("training.precision=bf16 (now fp32)")
        elif t.precision == "bf16" and device_type == "cuda":
            out.append("training.precision=fp8 (now bf16; GPUs of compute capability 8.9+)")
    elif phase != AFTER_STEP:  # weights, gradients and optimizer state: the step, a save's copy, the model's set-up
        if layout.data > 1 and layout.data_shard == 1 and not p.distributed_optimizer:
            out.append("parallel.distributed_optimizer=true (optimizer state sharded over the "
                       f"{layout.data} data-parallel ranks)")
        if layout.data > 1 and layout.data_shard == 1:
            out.append(f"parallel.data_shard={layout.data} (--data-shard: FSDP shards parameters and gradients "
                       "too)")
        if layout.data_shard > 1 and not p.fsdp_cpu_offload and device_type == "cuda":
            out.append("parallel.fsdp_cpu_offload=true (sharded state in host memory)")
        if phase == "checkpoint save" and cfg.checkpoint.async_save:
            out.append("checkpoint.async_save=false (its copy of the state in host memory)")
    out.append(f"more tensor or pipeline parallel (--tensor-parallel, --pipeline-parallel; now {layout.tensor} and "
               f"{layout.pipeline})")
    return out


def out_of_memory_error(oom: BaseException, cfg: TrainConfig, layout, phase: str, step: int, rank: int,
                        is_main: bool, device, newest: Path | None, compiling: bool = False) -> RunError:
    """The run's one line (rank 0; another rank's is short: rank 0's names the settings).
    `compiling`: the first step of training.compile, which compiles as it runs."""
    if phase == STEP:
        phase = step_phase(oom)
    t = cfg.training
    what = describe_out_of_memory(oom, device.index if device.type == "cuda" else None)
    where = f"step {step} ({phase}{', the first step, compiling' if compiling else ''})"
    if not is_main:
        return RunError(f"rank {rank}: {where}: {what}; rank 0's line (or docs/operations.md, \"Out of memory\") "
                        "names the settings to change")
    resume = (f"the newest checkpoint is {newest} (then --resume)" if newest is not None
              else "no checkpoint was saved yet")
    return RunError(f"{where} on {device}: {what}; layout {layout.short()}, micro-batch {t.micro_batch_size} x "
                    f"{t.seq_length} tokens, precision {t.precision}, recompute {t.recompute}. To fit, change: "
                    + "; ".join(levers(cfg, layout, phase, device.type)) + f". Nothing was saved: {resume}")
