"""Write (or read) a Megatron-Core DeepSeek-V3-class `torch_dist` checkpoint with megatron-core's own
GPTModel on CPU: multi-latent attention (MLASelfAttention), first-k dense layers, then MoE layers
(router with expert bias, SequentialMLP experts, shared experts).

Run as `python megatron_mla_save.py save|load SPEC.json DIR [SPEC.json DIR ...]` (one process for
several models: megatron-core's import is most of the time). `save`: builds the model in a
one-process gloo group with random weights, saves it with dist_checkpointing.save and writes
DIR/../megatron_params.pt (its own state_dict) and DIR/../reference.pt (input tokens and its
logits). `load`: loads DIR with dist_checkpointing.load into a fresh model and writes
DIR/../loaded_params.pt.

With `"mtp": D` in SPEC the model has D multi-token-prediction layers (`mtp_num_layers`), their
block spec made by megatron-core's own get_gpt_mtp_block_spec_for_backend from the decoder's last
layer spec (as Megatron-LM's pretrain_gpt does); reference.pt then also holds the labels, each
depth's logits (its output layer over the MTP block's hidden states) and each depth's loss as
GPTModel computes it (what it hands MTPLossAutoScaler, divided by the loss scale).

With `"local": true` in SPEC the layer spec is megatron-core's own get_gpt_layer_local_spec (MLA,
qk_layernorm: separate q/kv layernorm modules, a pre-MLP norm in dense layers too). Otherwise it is
Megatron's Transformer Engine one for MLA (get_gpt_layer_with_transformer_engine_spec
with multi_latent_attention and qk_layernorm: the q/kv latent norms fused into linear_q_up_proj /
linear_kv_up_proj, the dense MLP's norm into linear_fc1, TENorm elsewhere), what DeepSeek-V3 runs
train with; TE's layers are stood in for by megatron-core's local ones with TE's `layer_norm_weight`,
and TE's core attention (which has no parameters) by an empty module: megatron-core's local
DotProductAttention cannot run MLA's unequal q/k and v head widths, so the model is built for its
parameters and checkpoint names only, never run.
"""

import contextlib
import json
import os
import sys

import torch
import torch.distributed as dist
from megatron_cpu import init_cpu_process_group
from torch import nn


def build(spec: dict):
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_mtp_block_spec_for_backend,
    )
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer import multi_latent_attention
    from megatron.core.transformer.moe import moe_utils

    moe_utils.te_general_gemm = None  # without TE this name is undefined (a NameError); None: its torch.mm path
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention, MLASelfAttentionSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    from megatron.core.transformer.transformer_config import MLATransformerConfig
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    for name in ("TELinear", "TEColumnParallelLinear", "Linear"):  # without TE, mocks: classes nothing is
        if not isinstance(getattr(multi_latent_attention, name, None), type):  # an instance of, for its checks
            setattr(multi_latent_attention, name, type(name, (), {}))

    class LayerNormColumnParallelLinear(ColumnParallelLinear):  # TELayerNormColumnParallelLinear's tensors
        def __init__(self, input_size, output_size, **kwargs):
            super().__init__(input_size, output_size, **kwargs)
            self.layer_norm_weight = nn.Parameter(torch.ones(input_size))
            self.eps = kwargs["config"].layernorm_epsilon

        def forward(self, x, *args, **kwargs):  # TE's fused RMSNorm, then the linear layer
            return super().forward(torch.nn.functional.rms_norm(x, x.shape[-1:], self.layer_norm_weight, self.eps),
                                   *args, **kwargs)

    class CoreAttention(nn.Module):  # TEDotProductAttention: no parameters (the local one cannot do MLA)
        def __init__(self, *args, softmax_scale=None, **kwargs):
            super().__init__()
            self.scale = softmax_scale

        def forward(self, query, key, value, attention_mask, **kwargs):  # [s, b, h, d] -> [s, b, h * dv]
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
            return out.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)

    def layer(moe: bool) -> ModuleSpec:
        if spec.get("local"):  # megatron-core's own local spec (its norm names), with the attention stand-in
            local = get_gpt_layer_local_spec(num_experts=spec["num_experts"] if moe else None, qk_layernorm=True,
                                             multi_latent_attention=True, normalization="RMSNorm")
            local.submodules.self_attention.submodules.core_attention = CoreAttention
            return local
        mlp = (get_moe_module_spec(use_te=False, num_experts=spec["num_experts"], moe_grouped_gemm=False) if moe
               else ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=LayerNormColumnParallelLinear,
                                                                    linear_fc2=RowParallelLinear)))
        return ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
            input_layernorm=WrappedTorchNorm,
            self_attention=ModuleSpec(module=MLASelfAttention, params={"attn_mask_type": AttnMaskType.causal},
                                      submodules=MLASelfAttentionSubmodules(
                                          linear_q_proj=ColumnParallelLinear, linear_q_down_proj=ColumnParallelLinear,
                                          linear_q_up_proj=LayerNormColumnParallelLinear,
                                          linear_kv_down_proj=ColumnParallelLinear,
                                          linear_kv_up_proj=LayerNormColumnParallelLinear,
                                          core_attention=CoreAttention, linear_proj=RowParallelLinear,
                                          q_layernorm=IdentityOp, kv_layernorm=IdentityOp)),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=WrappedTorchNorm if moe else IdentityOp,
            mlp=mlp, mlp_bda=get_bias_dropout_add))

    pattern = [0] * spec["first_k_dense"] + [1] * (spec["num_layers"] - spec["first_k_dense"])
    cfg = MLATransformerConfig(
        num_layers=spec["num_layers"], hidden_size=spec["hidden_size"], num_attention_heads=spec["num_heads"],
        tensor_model_parallel_size=dist.get_world_size(),
        ffn_hidden_size=spec["ffn_hidden_size"], q_lora_rank=spec["q_lora_rank"], kv_lora_rank=spec["kv_lora_rank"],
        qk_head_dim=spec["qk_nope_head_dim"], qk_pos_emb_head_dim=spec["qk_rope_head_dim"],
        v_head_dim=spec["v_head_dim"], rope_type="rope", num_moe_experts=spec["num_experts"],
        moe_layer_freq=pattern if spec["first_k_dense"] else 1, moe_ffn_hidden_size=spec["moe_ffn_hidden_size"],
        moe_shared_expert_intermediate_size=spec["shared_ffn_hidden_size"], moe_router_topk=spec["top_k"],
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, moe_router_dtype="fp32",
        moe_router_topk_scaling_factor=spec["routed_scaling_factor"], moe_router_num_groups=spec["num_groups"],
        moe_router_group_topk=spec["topk_groups"],
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False,
        use_cpu_initialization=True, params_dtype=torch.float32, layernorm_epsilon=1e-6,
        mtp_num_layers=spec.get("mtp") or None, mtp_loss_scaling_factor=0.1)
    block = TransformerBlockSubmodules(layer_specs=[layer(bool(p)) for p in pattern], layer_norm=WrappedTorchNorm)

    class Backend(LocalSpecProvider):  # TESpecProvider's MTP modules (TENorm, TEColumnParallelLinear) stood in for
        def layer_norm(self, rms_norm: bool = False, for_qk: bool = False) -> type:
            return WrappedTorchNorm

    mtp = (get_gpt_mtp_block_spec_for_backend(cfg, block, LocalSpecProvider() if spec.get("local") else Backend())
           if spec.get("mtp") else None)
    return GPTModel(cfg, block, vocab_size=spec["rows"], max_sequence_length=64, position_embedding_type="none",
                    share_embeddings_and_output_weights=False, parallel_output=False, mtp_block_spec=mtp)


def forward(model, tokens: torch.Tensor, labels: torch.Tensor, depth: int) -> dict:
    """Megatron's logits [b, s, rows]; with MTP also each depth's logits (its output layer over the
    MTP block's hidden states, which GPTModel only turns into a loss) and loss as GPTModel computes it."""
    positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    model.eval()
    if not depth:
        with torch.no_grad():
            return {"logits": model(tokens, positions, attention_mask=None)}
    from megatron.core.models.gpt import gpt_model

    hidden, losses = [], []
    scale = model.config.mtp_loss_scaling_factor / depth

    class Recorder:  # in MTPLossAutoScaler's place: GPTModel hands it scale x masked per-token loss / tokens
        @staticmethod
        def apply(states, scaled):
            losses.append(scaled.sum() / scale)
            return states

    hook = model.mtp.register_forward_hook(lambda module, args, out: hidden.append(out))
    real, gpt_model.MTPLossAutoScaler = gpt_model.MTPLossAutoScaler, Recorder
    try:
        with torch.no_grad():
            model(tokens, positions, attention_mask=None, labels=labels)
            chunks = hidden[0].chunk(1 + depth, dim=0)  # [s, b, h] each: the main model's, then each depth's
            logits = [model.output_layer(c)[0].transpose(0, 1) for c in chunks]
    finally:
        gpt_model.MTPLossAutoScaler = real
        hook.remove()
    return {"logits": logits[0], "mtp_logits": torch.stack(logits[1:]), "mtp_losses": torch.stack(losses),
            "labels": labels}


def run(spec: dict, directory: str, mode: str) -> None:
    from megatron.core import dist_checkpointing

    torch.manual_seed(spec.get("seed", 0))
    model = build(spec)
    if mode == "save":
        with torch.no_grad():  # every tensor informative: no constant norms or biases
            for name, p in model.named_parameters():
                p.copy_(torch.randn_like(p) * (0.5 if p.ndim == 1 else 0.1) + (1.0 if "norm" in name else 0.0))
            for name, b in model.named_buffers():
                if name.endswith("expert_bias"):
                    b.copy_(0.1 * torch.randn_like(b))
        dist_checkpointing.save(model.sharded_state_dict(), directory)
        out = "megatron_params.pt"
        generator = torch.Generator().manual_seed(1)
        tokens, labels = (torch.randint(0, spec["vocab_size"], (2, 12), generator=generator) for _ in range(2))
        torch.save({"tokens": tokens, **forward(model, tokens, labels, spec.get("mtp", 0))},
                   os.path.join(directory, "..", "reference.pt"))
    else:
        model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), directory))
        out = "loaded_params.pt"
    if dist.get_world_size() > 1:  # tensor parallel: Megatron's logits from its shards of the checkpoint
        ref = torch.load(os.path.join(directory, "..", "tokens.pt"))
        out = forward(model, ref["tokens"], ref["labels"], spec.get("mtp", 0))
        if dist.get_rank() == 0:
            torch.save(out, os.path.join(directory, "..", f"logits_tp{dist.get_world_size()}.pt"))
        return
    torch.save({k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)},
               os.path.join(directory, "..", out))


def main() -> None:
    mode, pairs = sys.argv[1], sys.argv[2:]
    init_cpu_process_group()
    world = dist.get_world_size()  # > 1 under torchrun: load at tensor parallel `world`
    from megatron.core import parallel_state, tensor_parallel

    parallel_state.initialize_model_parallel(world, 1)
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()  # CUDA RNG: none here
    for spec, directory in zip(pairs[::2], pairs[1::2]):  # several models, one process: one megatron import
        run(json.loads(open(spec).read()), directory, mode)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
