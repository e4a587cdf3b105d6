"""Linear layers with oneDNN-prepacked weights for CPU serving.

On CPU, decode steps are mostly small GEMMs (a few to a few hundred rows against each projection's
weight): `benchmarks/serving_profile.py` put matrix multiplies at 67-70% of a decode step for the
issue-#18 workload (llama-25m, 32-64 concurrent). `F.linear` hands MKL/oneDNN the weight in its
plain layout every call; PyTorch's own oneDNN path can instead reorder the weight once, at load, into
the blocked layout its kernel reads (`torch.ops.mkldnn._reorder_linear_weight`) and run
`torch.ops.mkldnn._linear_pointwise` on it — the same prepacking vLLM's CPU build does with its own
oneDNN binding. About 0.7x `F.linear`'s time at decode batch sizes
(benchmarks/results/serving.md; MKL's packed GEMM was measured too, and rejected).

Results equal `F.linear`'s to rounding (relative error ~4e-7 in fp32: the blocked kernel sums in
another order), so `--cpu-linear aten` exists for anyone who wants the unpacked path.

What is packed: every `nn.Linear` the model calls as a module (attention and MLP projections, by
then stacked q/k/v and gate/up where `merged_linear.merge_projections` could, MoE routers; on a
tensor-parallel worker its stacked column-parallel shards, which are plain Linears). Not packed: the output head (`Transformer.logits` reads its weight, tied or not, to mask the
vocabulary padding in one place; 2-4% of a decode step), MoE experts (stacked parameters), quantized models (torchao owns their Linear weights), row-parallel layers (their
own forward), CUDA models (cuBLAS needs no prepacking) and models whose layer stack is compiled
(compiled.py: inductor's freezing packs the plain weights itself). `prepare.serving_runner` decides.

A packed weight is an opaque oneDNN tensor held outside `parameters()` and `state_dict()`: count a
served model's parameters from its config (`ModelConfig.num_params()`), never from the packed module.
"""

from __future__ import annotations

import torch
from torch import nn

PACKED_DTYPES = (torch.float32, torch.bfloat16)


def onednn_available(dtype: torch.dtype = torch.float32) -> bool:
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


class PackedLinear(nn.Module):
    """y = x W^T + b with W held in oneDNN's blocked layout (an opaque tensor, not a parameter)."""

    def __init__(self, linear: nn.Linear, batch_hint: int):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        y = torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias, "none", [], "")
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def pack_linears(model: nn.Module, backend: str = "onednn", batch_hint: int = 64) -> int:
    """Replace the model's `nn.Linear` modules by PackedLinear in place (CPU, fp32/bf16, backend "onednn");
    returns how many were packed (0 where it does not apply). `batch_hint` is the row count oneDNN
    picks its blocking for (the engine passes its max_num_seqs)."""
    if backend == "aten":
        return 0
    packed = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not nn.Linear or name == "lm_head":  # exact type: subclasses keep their forward;
                continue  # the head's weight is read by Transformer.logits, not called
            w = child.weight
            if (w.device.type != "cpu" or w.dtype not in PACKED_DTYPES or type(w) is not nn.Parameter
                    or not onednn_available(w.dtype)):
                continue
            setattr(parent, name, PackedLinear(child, batch_hint))
            packed += 1
    return packed
