"""One place that turns a loaded model into a served one: `serving_runner`.

Every model the server runs comes through here: the engine's (one device), each tensor-parallel
worker's shard (executor.py) and the speculative draft model (spec_decode/proposers.py), so they are all
prepared alike. On CPU, in order:
  1. q/k/v and gate/up stacked into one GEMM each (merged_linear.py);
  2. either the layer stack compiled by inductor, which prepacks the Linear weights for oneDNN
     itself (freezing) and fuses the elementwise ops around them (compiled.py), or, eager, the
     Linear weights prepacked for oneDNN (cpu_linear.py);
  3. the model runner, and with compile its forward warmed up (compiled) before it serves. When
     compile is the default, a model that cannot be compiled (mixture-of-experts, dynamic RoPE, a
     kind whose runner says why: `ModelRunner.eager_reason`, e.g. hybrid) or
     a compile that fails (say, no C++ compiler, a graph break) is logged as a warning and served
     eagerly with packed weights; when the user asked for it (cpu_compile=True), either is refused
     (UserError), as is cpu_compile=True on CUDA.
Quantized models (torchao owns their Linear weights) are merged but neither packed nor compiled.
Tensor-parallel shards are packed but not compiled (their row-parallel layers all-reduce inside
the forward; not traced here). On CUDA nothing is done here (decode steps use CUDA graphs:
cuda_graphs.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from tessera.common.errors import UserError
from tessera.inference.worker.compiled import COMPILE_ERRORS, CompiledForward, uncompilable
from tessera.inference.worker.cpu_linear import pack_linears
from tessera.inference.worker.kinds import serving_kind
from tessera.inference.worker.merged_linear import merge_projections
from tessera.inference.worker.model_runner import ModelRunner

log = logging.getLogger("tessera.inference")


@dataclass(frozen=True)
class ServingPrep:
    """How a model is prepared (from EngineConfig: `llm_engine.serving_prep(cfg)`)."""

    cpu_linear: str = "onednn"  # --cpu-linear ("aten" is never compiled: EngineConfig.compile_on_cpu)
    compile: bool = False  # inductor-compiled layer stack on CPU (EngineConfig.compile_on_cpu)
    explicit: bool = False  # compile asked for (cpu_compile=True), not the default: failing to is an error
    quantized: bool = False  # --quantization given
    batch_hint: int = 64  # rows the packed weights are blocked for (max_num_seqs)


def serving_runner(model: torch.nn.Module, prep: ServingPrep, num_blocks: int, block_size: int,
                   device: torch.device, dtype: torch.dtype, tp_rank: int = 0, tp_size: int = 1,
                   kv_dtype: torch.dtype | None = None, what: str = "model") -> ModelRunner:
    """The model prepared for serving (in place) and its runner, compiled and warmed up where asked."""
    compile_it = False
    kind = serving_kind(model.cfg)
    if device.type != "cpu" and prep.compile and prep.explicit:
        raise UserError(f"cpu_compile compiles the CPU forward; {what} is on {device.type} (decode steps use "
                        "CUDA graphs there): drop cpu_compile")
    kind.runner.prepare_model(model)
    if device.type == "cpu":
        merge_projections(model)  # q/k/v and gate/up: one GEMM each
        reason = (kind.runner.eager_reason or uncompilable(model.cfg, tp_size, prep.quantized)) if prep.compile else None
        if reason is not None:
            if prep.explicit:
                raise UserError(f"cpu_compile: {what} cannot be compiled ({reason}); drop cpu_compile to serve it "
                                "eagerly")
            # Quantized / tensor-parallel: the user's own flags, said in the docs; the model's nature: say it.
            log.log(logging.INFO if prep.quantized or tp_size > 1 else logging.WARNING,
                    "%s: %s: not compiled, runs eagerly", what, reason)
        compile_it = prep.compile and reason is None
        if not compile_it and not prep.quantized:
            pack_linears(model, prep.cpu_linear, batch_hint=prep.batch_hint)
    runner = kind.runner(model, num_blocks, block_size, device, dtype, tp_rank, tp_size, kv_dtype=kv_dtype,
                         **kind.runner.serving_kwargs(prep))
    if compile_it:
        compiled = runner.compiled = CompiledForward(model, prep.batch_hint)
        try:
            seconds = compiled.warm_up(runner.forward_batch, prep.batch_hint)
        except COMPILE_ERRORS as exc:  # e.g. no C++ compiler on this machine
            runner.compiled = None
            compiled.discard()  # a graph compiled before the failure holds frozen weights
            lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
            # BackendCompilerFailed's first line is "backend='inductor' raised:", the cause the next.
            first = " ".join(lines[:2] if lines and lines[0].endswith("raised:") else lines[:1])
            if prep.explicit:
                raise UserError(f"cpu_compile: compiling {what}'s layer stack failed ({type(exc).__name__}: "
                                f"{first}); drop cpu_compile to serve it eagerly") from exc
            log.warning("%s: compiling the layer stack failed (%s: %s); serving eagerly (--enforce-eager skips "
                        "the attempt)", what, type(exc).__name__, first)
            pack_linears(model, prep.cpu_linear, batch_hint=prep.batch_hint)
        else:
            log.info("%s: compiled the layer stack for CPU serving in %.1f s (--enforce-eager serves without)",
                     what, seconds)
    return runner
