"""A compiled forward for CPU serving: the layer stack through inductor, attention kept eager.

What vLLM's CPU build does (vllm/platforms/cpu.py: its model traced once by dynamo and compiled by
inductor, the batch dimension dynamic). A llama decode step on CPU is oneDNN GEMMs plus ~50 small
eager ops per layer (RMSNorm, RoPE, SiLU * mul, residual adds, views) and their dispatch, ~3 of
a 13 ms step for llama-25m at 8 sequences (benchmarks/serving_profile.py); inductor fuses those
into a few C++ loops per layer and runs the whole stack from one Python call.

Shape of it:
- One graph for the whole stack. Attention (the KV write and the paged attention, whose step
  state is Python lists of decode groups) stays eager and opaque: `attention_op`, a custom op with
  tensor inputs that runs the executing step's attention callable, as vLLM's attention op reads its
  forward context. A graph break at each attention call instead (torch._dynamo.disable) was
  measured and rejected: dynamo resumes each layer's Block.forward as a frame of its own, the
  layers share one code object and guard on their own weights, so 8 layers x 2 shapes hit
  dynamo's recompile limit (8) and the rest runs eagerly: 1.40x / 1.40x / 1.18x the eager forward's
  time at 8 / 32 / 64 rows, where the custom op took 0.88x / 0.82x / 0.89x (llama-25m, fp32, one
  thread, ModelRunner decode forwards A/B/C alternating, ratio of medians, the 2-core CPU shared by
  six agents).
- The token count is dynamic and unbacked (`mark_unbacked`: no specialisation on its value, not
  even on 1): one compile serves every decode batch size, a lone sequence's decode step and every
  prefill chunk. It is compiled at engine start (`warm_up`), before the server is healthy.
  `mark_dynamic` instead specialises a size of 1 into a second graph (twice the compile time);
  measured against it (ModelRunner decode forwards, A/B/C alternating, the loaded CPU): unbacked
  0.73x / 0.99x / 0.98x the eager time at 8 / 32 / 64 rows, mark_dynamic 0.84x / 0.89x / 0.98x,
  equal within the noise, so one graph.
- Freezing: the weights become constants, so inductor prepacks every Linear weight for oneDNN
  (`mkldnn._linear_pointwise`, or MKL's packed GEMM in the static graph) and fuses bias, SiLU and
  the residual adds into the GEMM calls. The weights are therefore left plain (not
  cpu_linear.PackedLinear) for a compiled model: dynamo traces `_linear_pointwise` with an opaque
  packed weight, but inductor lowers it only for a frozen constant, and a PackedLinear's weight
  is a plain attribute, which freezing does not fold (AssertionError in mkldnn_lowerings). The
  packed copies are held by the compiled graph beside the module's plain weights (twice the
  Linear weights' memory). oneDNN blocks a packed weight for a row count: for an unbacked size
  inductor takes `unbacked_symint_fallback`, set to the engine's max_num_seqs (as the eager
  PackedLinear's batch hint). Without freezing inductor packs nothing and calls plain `mm` (slower
  than eager oneDNN: 1.02-1.17x the eager forward's time). Freezing is an inductor setting read
  outside the per-compile options, so the settings are patched around each call (under a process
  lock: a patch saves and restores module globals), never set for the process. The plain weights
  cannot be dropped (inductor's freezing_discard_parameters): the output head, tied to the
  embedding in GPT-2-style models, is read outside the graph, and dynamo's guards read the
  parameters at every call. `--cpu-linear aten` (no packing) is served eagerly, not compiled:
  inductor's cpp.weight_prepack=False was tried and does not hold per model, since inductor
  registers its freezing patterns (the weight packing among them) once per process, at the first
  frozen compile, and applies them to every later one (a second model compiled with it off still
  had its 4 Linears packed).
- Each CompiledForward compiles a code object of its own (a copy of `_forward`'s): dynamo keeps
  graphs per code object, so a second model of the same shape compiles its own graph and never
  reuses another's frozen weights (checked with two seeds of one config; outputs equal each
  model's eager ones), the graphs are freed with their CompiledForward, and dynamo's recompile
  limit (8 graphs per code object) is per model: with one shared code object the 9th model in a
  process ran its stack eagerly, unpacked, with a warning only. Compiled `fullgraph` and under
  `fail_on_recompile_limit_hit`: a graph break or the limit raises, in warm_up, and
  prepare.serving_runner serves eagerly with packed weights (or refuses, cpu_compile asked for).

Inductor options are vLLM's CPU build's (dce, no size/NaN asserts, epilogue fusion, dynamic
threads; one compile thread).

Measured (issue #18; llama-25m, fp32, one thread; `benchmarks/serving_profile.py --compile-ab 8 32
64`: two engines holding the same 8 / 32 / 64 greedy requests, stepped alternately, decode steps
only; the 2-core CPU shared by six agents, so ratios of medians, noisy): compiled steps took
0.82x / 0.81x / 0.88x of the eager (oneDNN-packed) ones (medians of per-step ratios 0.84x / 0.88x /
0.89x, quartiles about +-0.1); two earlier runs with mark_dynamic's two graphs 0.76x / 0.86x /
0.86x and 0.92x / 0.87x / 0.97x. Compiling took 81-113 s there at engine start (tiny test models 30-80 s; inductor's
kernel cache makes a second start of the same model faster). ModelRunner decode forwards alone
(A/B/C alternating, a quieter moment: eager 14.3 ms at 8 rows): compiled 0.93x / 0.96x / 0.96x
at 8 / 32 / 64 rows; with inductor's cpp_wrapper (C++ instead of Python calling the kernels)
1.03x / 1.07x / 1.13x, rejected. Not tried: the output head inside the graph (2-5% of a step,
unpacked today). So compile is the CPU default, as in vLLM; `--enforce-eager` serves without, and the test suite sets
TESSERA_CPU_COMPILE=0 (config.CPU_COMPILE_ENV) so that engines in tests start at once.

Not compiled (eager, with prepacked weights; `uncompilable` says why): models whose forward reads
values back on the host (mixture-of-experts routing, dynamic RoPE scaling; the same rule as CUDA
graphs), quantized weights, tensor-parallel shards.
"""

from __future__ import annotations

import logging
import threading
import time
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
import torch._dynamo
import torch._inductor.exc

from tessera.inference.worker.batch import BatchSeq
from tessera.inference.worker.cuda_graphs import uncapturable

if TYPE_CHECKING:
    from tessera.common.model_config import ModelConfig

log = logging.getLogger("tessera.inference")

# The model's attention hook: (layer, q, k, v) -> attention output, K/V written into the cache.
AttentionFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

# The attention of the step being executed, per thread: `attention_op` calls the innermost (vLLM's
# attention op reads its forward context the same way). Set only around one forward (`_running`),
# so nothing outlives the step.
_LOCAL = threading.local()


def _attentions() -> list[AttentionFn]:
    if not hasattr(_LOCAL, "attentions"):
        _LOCAL.attentions = []
    return _LOCAL.attentions


@contextmanager
def _running(attention: AttentionFn) -> Iterator[None]:
    attentions = _attentions()
    attentions.append(attention)
    try:
        yield
    finally:
        attentions.pop()


# It writes the KV cache, which is not one of its inputs, so the compiler would take it for a pure
# function: registered as side-effecting so that no dead-code pass may ever drop it (its output is
# always used today, but the KV write must not depend on that).
@torch.library.custom_op("tessera_inference::attention", mutates_args=())
def attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    """The executing step's attention for `layer` (KV write + paged attention), opaque to the compiler."""
    return _attentions()[-1](layer, q, k, v).contiguous()  # the fake's layout


@attention_op.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    return q.new_empty(q.shape)


torch.fx.node.has_side_effect(torch.ops.tessera_inference.attention.default)


def _attention_fn(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return attention_op(q, k, v, layer)


# Inductor settings while compiling (vLLM's CPU build's, plus freezing; see the module docstring).
_CONFIG = {
    "freezing": True,
    "dce": True,
    "size_asserts": False,
    "nan_asserts": False,
    "epilogue_fusion": True,
    "cpp.dynamic_threads": True,
    "compile_threads": 1,
}
# The inductor and dynamo settings are process-wide (a patch is a save, set and restore of
# module globals), so two threads patching at once could leave freezing on for the process: every
# compiled call takes this lock around its patches.
_CONFIG_LOCK = threading.RLock()

# What a compile that cannot be done raises (dynamo: a graph break under fullgraph, an unsupported
# construct, the backend failing; inductor: no working C++ compiler, a kernel that does not build;
# dynamo's recompile limit, raised under fail_on_recompile_limit_hit). Anything else is a bug and
# propagates.
COMPILE_ERRORS: tuple[type[BaseException], ...] = (
    torch._dynamo.exc.TorchDynamoException,
    torch._dynamo.exc.FailOnRecompileLimitHit,
    torch._inductor.exc.InvalidCxxCompiler,
    torch._inductor.exc.CppCompileError,
)


def uncompilable(cfg: ModelConfig, tp_size: int = 1, quantized: bool = False) -> str | None:
    """Why this model is served eagerly on CPU, or None when its layer stack can be compiled."""
    if quantized:
        return "quantized weights"
    if tp_size > 1:
        return "a tensor-parallel shard"
    return uncapturable(cfg)


class CompiledForward:
    """model(tokens [1, T], positions [1, T]) -> final-normed hidden [1, T, d] through inductor,
    attention through the callable given to each call."""

    def __init__(self, model: torch.nn.Module, rows: int = 64):
        self.model = model
        self.seconds = 0.0  # spent compiling in warm_up
        # `rows`: the batch size the packed weights are blocked for (the engine's max_num_seqs).
        self._config = {**_CONFIG, "unbacked_symint_fallback": rows}
        # A code object of its own: dynamo keeps its graphs (and the frozen weights they pin) on
        # the code object, so they die with this instance, and its recompile limit counts this
        # model's graphs only (shared, 8 models per process would exhaust it and the 9th run
        # eagerly with unpacked weights).
        forward = types.FunctionType(CompiledForward._forward.__code__.replace(), globals(), "_forward")
        self.code = forward.__code__
        # fullgraph: a graph break raises (in warm_up) instead of splitting the stack.
        self._fn = torch.compile(types.MethodType(forward, self), backend="inductor", dynamic=False,
                                 fullgraph=True)

    def _forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(tokens, positions=positions, attention_fn=_attention_fn, return_hidden=True)

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, attention: AttentionFn) -> torch.Tensor:
        with (torch.inference_mode(), _running(attention), _CONFIG_LOCK, torch._inductor.config.patch(self._config),
              torch._dynamo.config.patch(fail_on_recompile_limit_hit=True)):
            # Inputs laid out as the warm-up's, else dynamo's guards fail and it recompiles: the decode
            # graphs hand in rows of their static buffers (views, made outside inference mode).
            tokens, positions = (t.clone(memory_format=torch.contiguous_format) if t._base is not None
                                 or not t.is_inference() else t for t in (tokens, positions))
            torch._dynamo.decorators.mark_unbacked(tokens, 1)
            torch._dynamo.decorators.mark_unbacked(positions, 1)
            return self._fn(tokens, positions)

    def graphs(self) -> int:
        """How many graphs dynamo holds for this model (1 after warm_up: one for every token count)."""
        return len(torch._dynamo.eval_frame._debug_get_cache_entry_list(self.code))

    def discard(self) -> None:
        """Drop the compiled graphs (and the frozen weights they hold), say after a failed warm_up."""
        torch._dynamo.reset_code(self.code)

    def warm_up(self, forward_batch: Callable[[list[BatchSeq], list[int]], torch.Tensor], rows: int) -> float:
        """Compile before serving, through the runner's `forward_batch` (a decode step of `rows`
        sequences, then one of a single sequence, which must reuse the graph); returns the seconds
        it took. The dummy decode steps write K/V into block 0's first slot only, which its next
        owner overwrites before reading."""
        t = time.perf_counter()
        with torch.inference_mode():
            for n in (max(2, rows), 1):
                forward_batch([BatchSeq([0], 0, [0], 1) for _ in range(n)], list(range(n)))
        self.seconds = time.perf_counter() - t
        return self.seconds
