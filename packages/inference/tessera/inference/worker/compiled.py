"""A compiled forward for CPU serving: the layer stack through inductor, attention kept eager.

As vLLM's CPU build: a CPU decode step of a small model is oneDNN GEMMs plus dozens of small eager
ops per layer and their dispatch; inductor fuses those into a few C++ loops and runs the stack from
one Python call. One graph over a dynamic (unbacked) token count serves every batch, compiled at
engine start (`warm_up`). Attention (KV write + paged attention) stays eager inside it as an opaque
custom op that calls the executing step's attention callable. The weights are frozen, so inductor
packs them for oneDNN itself (plain weights here, not cpu_linear.PackedLinear); each CompiledForward
compiles its own code object, so its graphs and the frozen weights they hold are its own.
`uncompilable` says which models run eagerly instead. Why each choice, and the alternatives measured
and rejected: benchmarks/results/serving.md ("Measurements behind the serving code's design") and
docs/cli/tessera-serve.md ("Compiled layer stack on CPU").
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
    from tessera.common.models.causal_lm.config import ModelConfig

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
