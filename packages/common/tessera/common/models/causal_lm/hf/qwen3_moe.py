"""Qwen3-MoE (transformers' `Qwen3MoeForCausalLM`) <-> Tessera.

Qwen3's attention (q/k norm, explicit head_dim) with sparse MLPs: `mlp.gate` (router, [E, d])
and `mlp.experts.<e>.gate_proj/up_proj/down_proj` (`moe_intermediate_size` wide); the layers in
`mlp_only_layers` keep a dense MLP (`intermediate_size` wide). Routing: softmax, top-k,
renormalised when `norm_topk_prob`. Tessera expresses dense layers as the first k
(`first_k_dense`), so `mlp_only_layers` must be 0..k-1 and `decoder_sparse_step` 1.
"""

from __future__ import annotations

from typing import Any

from tessera.common.errors import UserError
from tessera.common.hf.architecture import HFConfig
from tessera.common.models.causal_lm.config import ModelConfig
from tessera.common.models.causal_lm.hf.qwen3 import Qwen3


class Qwen3Moe(Qwen3):
    model_type, hf_class, arch = "qwen3_moe", "Qwen3MoeForCausalLM", "qwen3_moe"

    def config_fields(self, c: HFConfig) -> dict[str, Any]:
        c.require("decoder_sparse_step", c.integer("decoder_sparse_step", 1), (1,),
                  "Tessera's sparse layers are every layer after the first dense ones")
        dense = c.data.get("mlp_only_layers") or []
        if not isinstance(dense, list) or dense != list(range(len(dense))):
            c.fail("mlp_only_layers", f"= {dense!r} is not supported (Tessera keeps the first k layers dense: "
                   "it must be [0, 1, ..., k-1])")
        experts = c.integer("num_experts", None) or c.integer("num_local_experts")
        moe = dict(num_experts=experts, top_k=c.integer("num_experts_per_tok"),
                   ffn_hidden_size=c.integer("moe_intermediate_size"), norm_topk_prob=c.flag("norm_topk_prob", False),
                   aux_loss_coef=c.number("router_aux_loss_coef", 0.0), first_k_dense=len(dense))
        return {**super().config_fields(c), "moe": moe}

    def hf_fields(self, cfg: ModelConfig) -> dict[str, Any]:
        moe = cfg.moe
        assert moe is not None
        return {**super().hf_fields(cfg), "num_experts": moe.num_experts, "num_experts_per_tok": moe.top_k,
                "moe_intermediate_size": moe.ffn_hidden_size, "norm_topk_prob": moe.norm_topk_prob,
                "router_aux_loss_coef": moe.aux_loss_coef, "decoder_sparse_step": 1,
                "mlp_only_layers": list(range(moe.first_k_dense)), "output_router_logits": False}

    def check_exportable(self, cfg: ModelConfig) -> None:
        super().check_exportable(cfg)
        moe = cfg.moe
        want = dict(score="softmax", routed_scaling_factor=1.0, num_shared_experts=0, shared_ffn_hidden_size=None,
                    num_groups=1, bias_balancing=False, capacity_factor=None, layer_freq=1)
        wrong = {k: getattr(moe, k) for k, v in want.items() if moe is None or getattr(moe, k) != v}
        if moe is None or wrong:
            raise UserError(f"model config: moe {wrong or None} has no {self.hf_class} equivalent (softmax top-k "
                            "routing, no shared experts, every layer sparse after the first dense ones)")
