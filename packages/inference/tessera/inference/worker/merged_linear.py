"""Merged projections for CPU serving: q/k/v in one GEMM, the SwiGLU gate/up in one GEMM.

vLLM's QKVParallelLinear / MergedColumnParallelLinear idea, done at load time. Checkpoints keep
q/k/v and gate/up split (the layout contract in common/models/causal_lm/model.py: a tensor-parallel shard of each is
a contiguous slice), so the serving engine stacks the weights by rows once, when it prepares the
model: each Attention's `project` becomes one GEMM over [Wq; Wk; Wv] and a split, each dense SwiGLU
MLP's `gate_up` one GEMM over [Wgate; Wup] and a split. A llama layer then runs 4 GEMMs instead of
7 (llama-25m: 57 -> 33 per decode step with the head), each with a wider output, which oneDNN and
MKL run at a better rate than three or two narrow ones over the same input rows.

The gain, measured: a few percent of a decode step (benchmarks/results/serving.md).

Outputs equal the split layers' to rounding: every output column is the same dot product, only the
kernel's blocking may sum in another order (tests/inference/test_merged_projections.py).

Applies to: the Llama, Mistral, Qwen2 (q/k/v biases, stacked too; a missing one is zeros) and Qwen3
(q/k norm, applied after the split as before) attention, dense SwiGLU MLPs, GPT-2's attention.
Under tensor parallel each worker stacks its own shards (its heads' rows of q, k and v), and the
stacked layer is a plain Linear: a column-parallel layer without sequence parallel is exactly that in
a forward. Int8 weight-only weights (`--quantization int8`) are stacked too: their int8 rows and
per-row scales, exactly what quantizing the stacked weights would give. Left split (and logged):
MoE experts and routers (stacked parameters of their own), sequence-parallel layers, weights of mixed
dtypes or quantized per tensor, and models on CUDA (not measured there yet; the Triton kernels would
take the split views).

The stacked module replaces the split ones, so a served model's parameter names differ from the
checkpoint's (`attn.qkv_proj`, `mlp.gate_up_proj`); the serving engine never writes weights back.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from tessera.common.layers.mlp import MLP
from tessera.common.layers.self_attention import Attention
from tessera.common.parallel.layers import ColumnParallelLinear

log = logging.getLogger("tessera.inference")


class MergedAttention(Attention):
    """Attention whose q, k and v come from one GEMM over the stacked weights (`qkv_proj`)."""

    qkv_proj: nn.Linear
    qkv_sizes: list[int]

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = self.qkv_proj(x).split(self.qkv_sizes, dim=-1)
        return q, k, v


class MergedMLP(MLP):
    """A SwiGLU MLP whose gate and up come from one GEMM over the stacked weights (`gate_up_proj`)."""

    gate_up_proj: nn.Linear

    def gate_up(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return gate, up


def _stackable(layers: list[nn.Module]) -> bool:
    """Plain (or column-parallel with F.linear and without sequence parallel) Linear layers on CPU
    over the same input."""
    for lin in layers:
        if type(lin) is ColumnParallelLinear:
            if lin.sequence_parallel or lin.local_linear is not F.linear:  # e.g. FP8 training's matmul
                return False
        elif type(lin) is not nn.Linear:
            return False
        if lin.weight.device.type != "cpu" or lin.in_features != layers[0].in_features:
            return False
    return True


def _stack_weights(weights: list[torch.Tensor]) -> torch.Tensor | None:
    """The weights stacked by rows, or None where they cannot be. Ordinary float weights of one dtype
    are concatenated. Quantized weights (torchao tensors, e.g. int8 weight-only: int8 rows and one
    scale per row) are stacked tensor by tensor when every one is quantized per row in the same way,
    which is what quantizing the stacked float weights would give (a row's scale depends only on its
    row); torchao implements no `cat` for them."""
    first = weights[0]
    if all(type(w) is nn.Parameter and w.dtype == first.dtype for w in weights):
        return torch.cat(weights)
    cls = type(first)
    data_names = getattr(cls, "tensor_data_names", None)
    if data_names is None or any(type(w) is not cls for w in weights):
        return None
    attr_names = [*cls.tensor_attribute_names, *getattr(cls, "optional_tensor_attribute_names", [])]
    if any(getattr(w, a) != getattr(first, a) for w in weights for a in attr_names):
        return None
    block = getattr(first, "block_size", None)
    if block is None or block[0] != 1:
        return None  # per-row quantization only
    data = {}
    for name in [*data_names, *getattr(cls, "optional_tensor_data_names", [])]:
        parts = [getattr(w, name, None) for w in weights]
        if all(t is None for t in parts):
            continue
        # Every tensor of the weight (int8 rows, scales, zero points) must hold one entry per row.
        if any(t is None or t.dim() == 0 or t.shape[0] != w.shape[0] for t, w in zip(parts, weights)):
            return None
        data[name] = torch.cat(parts)
    return cls(**data, **{a: getattr(first, a) for a in attr_names})


@torch.no_grad()
def stack_linears(layers: list[nn.Linear]) -> nn.Linear | None:
    """One Linear computing the layers' outputs side by side (weights stacked by rows; biases too,
    zeros for a layer without one), or None where their weights cannot be stacked."""
    weight = _stack_weights([lin.weight for lin in layers])
    if weight is None:
        return None
    has_bias = any(lin.bias is not None for lin in layers)
    out = nn.Linear(weight.shape[1], weight.shape[0], bias=has_bias, device="meta")
    out.weight = nn.Parameter(weight, requires_grad=False)
    if has_bias:
        like = next(lin.bias for lin in layers if lin.bias is not None)
        out.bias = nn.Parameter(torch.cat([lin.bias if lin.bias is not None else like.new_zeros(lin.out_features)
                                           for lin in layers]), requires_grad=False)
    return out


def merge_projections(model: nn.Module) -> int:
    """Stack q/k/v and gate/up of every layer that allows it, in place (see the module docstring);
    returns how many stacked layers were made, and logs the layers left split and why."""
    # Each layer keeps its instance (norms, window, head counts) and swaps its class for the merged
    # subclass, whose only difference is `project` / `gate_up` (as FSDP2's fully_shard swaps classes).
    merged = 0
    left: list[str] = []
    for name, module in list(model.named_modules()):
        if type(module) is Attention:
            split = [module.q_proj, module.k_proj, module.v_proj]
            qkv = stack_linears(split) if _stackable(split) else None
            if qkv is None:
                left.append(f"{name}.q/k/v_proj")
                continue
            del module.q_proj, module.k_proj, module.v_proj
            module.__class__ = MergedAttention
            module.qkv_proj = qkv
            module.qkv_sizes = [lin.out_features for lin in split]
            merged += 1
        elif type(module) is MLP and module.gated:
            split = [module.gate_proj, module.up_proj]
            gate_up = stack_linears(split) if _stackable(split) else None
            if gate_up is None:
                left.append(f"{name}.gate/up_proj")
                continue
            del module.gate_proj, module.up_proj
            module.__class__ = MergedMLP
            module.gate_up_proj = gate_up
            merged += 1
    if left:
        log.info("projections left split (%d): %s ... (not CPU, not plain or per-row quantized Linear weights of "
                 "one kind, or sequence parallel)", len(left), ", ".join(left[:3]))
    return merged
