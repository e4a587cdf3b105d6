"""Write (or read) a Megatron-Core hybrid `torch_dist` checkpoint with megatron-core's own MambaModel on CPU.

Run as `python megatron_mamba_save.py SPEC.json DIR save|load`. `save`: builds MambaModel (Megatron's
MambaStack, MambaLayer/MambaMixer, TransformerLayer attention, MLPLayer, MoE layer with its
SequentialMLP experts, whose checkpoint keys its docs call interchangeable with TEGroupedMLP's) in a
one-process gloo group with random weights, saves it with dist_checkpointing.save, and writes
DIR/../megatron_params.pt: the model's own state_dict (its fused in-memory layouts). `load`: loads
DIR with dist_checkpointing.load into a fresh model and writes DIR/../loaded_params.pt.

What megatron-core needs and this CPU machine lacks is stood in for; none of it is run, only built
for its parameters and state-dict names:
- mamba_ssm's gated RMSNorm (a `weight` of d_inner channels, as mamba_ssm's) and its scan kernels,
  einops (imported by the mixer, used only in forward);
- Transformer Engine's layers of Megatron's mamba_stack_spec: TELayerNormColumnParallelLinear is
  Megatron's local ColumnParallelLinear plus TE's fused `layer_norm_weight` (replicated over tensor
  ranks, as TE's sharded_state_dict leaves it), TERowParallelLinear the local RowParallelLinear,
  TENorm (pre-MLP and final norms) torch's RMSNorm (`weight`), TEDotProductAttention the local one.
"""

import json
import os
import sys
import types

import torch
import torch.distributed as dist
from megatron_cpu import init_cpu_process_group
from torch import nn


class _GatedRMSNorm(nn.Module):  # mamba_ssm.ops.triton.layernorm_gated.RMSNorm's parameters
    def __init__(self, hidden_size, eps=1e-5, group_size=None, norm_before_gate=True, device=None, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))
        self.register_parameter("bias", None)


def _stub_modules() -> None:
    def stub(name: str, **attrs) -> None:
        module = types.ModuleType(name)
        module.__dict__.update(attrs)
        sys.modules[name] = module

    for name in ("mamba_ssm", "mamba_ssm.ops", "mamba_ssm.ops.triton"):
        stub(name)
    stub("mamba_ssm.ops.triton.layernorm_gated", RMSNorm=_GatedRMSNorm)
    stub("mamba_ssm.ops.triton.ssd_combined", mamba_chunk_scan_combined=None, mamba_split_conv1d_scan_combined=None)
    stub("mamba_ssm.ops.triton.selective_state_update", selective_state_update=None)
    if "einops" not in sys.modules:
        try:
            import einops  # noqa: F401
        except ImportError:
            stub("einops", rearrange=None, repeat=None)


def build(spec: dict):
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.models.mamba.mamba_model import MambaModel
    from megatron.core.ssm import mamba_block
    from megatron.core.ssm.mamba_block import MambaStack, MambaStackSubmodules
    from megatron.core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules
    from megatron.core.ssm.mamba_mixer import MambaMixer, MambaMixerSubmodules
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_layer import (
        MoETransformerLayer,
        TransformerLayer,
        TransformerLayerSubmodules,
    )

    class LayerNormColumnParallelLinear(ColumnParallelLinear):  # TELayerNormColumnParallelLinear's tensors
        def __init__(self, input_size, output_size, **kwargs):
            super().__init__(input_size, output_size, **kwargs)
            self.layer_norm_weight = nn.Parameter(torch.ones(input_size))

    mamba_block.TENorm = WrappedTorchNorm  # the final norm MambaStack builds
    spec_ = ModuleSpec(module=MambaStack, submodules=MambaStackSubmodules(
        mamba_layer=ModuleSpec(module=MambaLayer, submodules=MambaLayerSubmodules(
            mixer=ModuleSpec(module=MambaMixer, submodules=MambaMixerSubmodules(
                in_proj=LayerNormColumnParallelLinear, out_proj=RowParallelLinear)),
            mamba_bda=get_bias_dropout_add)),
        attention_layer=ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
            self_attention=ModuleSpec(module=SelfAttention, params={"attn_mask_type": AttnMaskType.causal},
                                      submodules=SelfAttentionSubmodules(
                                          linear_qkv=LayerNormColumnParallelLinear,
                                          core_attention=DotProductAttention, linear_proj=RowParallelLinear)),
            self_attn_bda=get_bias_dropout_add)),
        mlp_layer=ModuleSpec(module=MLPLayer, submodules=TransformerLayerSubmodules(
            mlp=ModuleSpec(module=MLP, submodules=MLPSubmodules(
                linear_fc1=LayerNormColumnParallelLinear, linear_fc2=RowParallelLinear)),
            mlp_bda=get_bias_dropout_add)),
        moe_layer=ModuleSpec(module=MoETransformerLayer, submodules=TransformerLayerSubmodules(
            pre_mlp_layernorm=WrappedTorchNorm,
            mlp=get_moe_module_spec(use_te=False, num_experts=spec["num_experts"], moe_grouped_gemm=False),
            mlp_bda=get_bias_dropout_add)),
    ))
    cfg = TransformerConfig(
        num_layers=len(spec["pattern"]), hidden_size=spec["hidden_size"], num_attention_heads=spec["num_heads"],
        num_query_groups=spec["num_kv_heads"], kv_channels=spec["head_dim"], ffn_hidden_size=spec["ffn_hidden_size"],
        mamba_num_heads=spec["mamba_num_heads"], mamba_head_dim=spec["mamba_head_dim"],
        mamba_state_dim=spec["mamba_state_dim"], mamba_num_groups=spec["mamba_num_groups"],
        num_moe_experts=spec["num_experts"], moe_ffn_hidden_size=spec["moe_ffn_hidden_size"],
        moe_router_topk=spec["top_k"], moe_shared_expert_intermediate_size=spec["shared_ffn_hidden_size"],
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, moe_router_dtype="fp32",
        activation_func=lambda x: torch.square(torch.relu(x)), gated_linear_unit=False, normalization="RMSNorm",
        add_bias_linear=False, use_cpu_initialization=True, params_dtype=torch.float32, layernorm_epsilon=1e-5)
    return MambaModel(cfg, spec_, vocab_size=spec["rows"], max_sequence_length=64,
                      hybrid_override_pattern=spec["pattern"], share_embeddings_and_output_weights=False)


def main() -> None:
    spec = json.loads(open(sys.argv[1]).read())
    directory, mode = sys.argv[2], sys.argv[3]
    _stub_modules()
    init_cpu_process_group()
    import contextlib

    from megatron.core import dist_checkpointing, parallel_state, tensor_parallel

    parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()  # CUDA RNG: none here
    torch.manual_seed(spec.get("seed", 0))
    model = build(spec)
    if mode == "save":
        with torch.no_grad():  # every tensor informative: no constant norms, D or biases
            for name, p in model.named_parameters():
                p.copy_(torch.randn_like(p) * (0.5 if p.ndim == 1 else 0.1) + (1.0 if "norm" in name else 0.0))
            for name, b in model.named_buffers():
                if name.endswith("expert_bias"):
                    b.copy_(0.1 * torch.randn_like(b))
        dist_checkpointing.save(model.sharded_state_dict(), directory)
        out = "megatron_params.pt"
    else:
        model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), directory))
        out = "loaded_params.pt"
    torch.save({k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)},
               os.path.join(directory, "..", out))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
