"""Mixtral (transformers' `MixtralForCausalLM`) <-> Tessera.

Mistral's attention with a sparse MLP on every layer: `block_sparse_moe.gate` (the router,
[E, d]) and experts `block_sparse_moe.experts.<e>.w1/w3/w2` (gate/up/down, one tensor per
expert, as transformers 5 still saves them). Routing: softmax, top-k, renormalised.
"""

from __future__ import annotations

from typing import Any

from tessera.common.hf.architecture import HFConfig
from tessera.common.models.causal_lm.config import ModelConfig
from tessera.common.models.causal_lm.hf.llama import LlamaFamily, sliding_from_hf


class Mixtral(LlamaFamily):
    model_type, hf_class, arch = "mixtral", "MixtralForCausalLM", "mixtral"
    expert_prefix = "block_sparse_moe."
    expert_names = ("w1", "w3", "w2")

    def config_fields(self, c: HFConfig) -> dict[str, Any]:
        c.require("router_jitter_noise", c.number("router_jitter_noise", 0.0), (0.0,),
                  "Tessera's router has no jitter noise")
        fields = self.common_fields(c)
        moe = dict(num_experts=c.integer("num_local_experts"), top_k=c.integer("num_experts_per_tok"),
                   ffn_hidden_size=fields["ffn_hidden_size"], norm_topk_prob=True,
                   aux_loss_coef=c.number("router_aux_loss_coef", 0.0))
        return {**fields, "moe": moe, **sliding_from_hf(c, fields["num_layers"], qwen=False)}

    def hf_fields(self, cfg: ModelConfig) -> dict[str, Any]:
        moe = cfg.moe
        assert moe is not None
        return {**self.common_hf_fields(cfg), "intermediate_size": moe.ffn_hidden_size,
                "sliding_window": cfg.sliding_window, "num_local_experts": moe.num_experts,
                "num_experts_per_tok": moe.top_k, "router_aux_loss_coef": moe.aux_loss_coef,
                "router_jitter_noise": 0.0, "output_router_logits": False}

    def check_exportable(self, cfg: ModelConfig) -> None:
        super().check_exportable(cfg)
        self._refuse_fields(cfg, {"bias": False, "attention_bias": None, "sliding_window_layers": None},
                            "Mixtral has no biases and windows every layer alike")
        moe = cfg.moe
        want = dict(score="softmax", norm_topk_prob=True, routed_scaling_factor=1.0, num_shared_experts=0,
                    shared_ffn_hidden_size=None, num_groups=1, bias_balancing=False, capacity_factor=None,
                    first_k_dense=0, layer_freq=1, ffn_hidden_size=cfg.ffn_hidden_size)
        wrong = {k: getattr(moe, k) for k, v in want.items() if moe is None or getattr(moe, k) != v}
        if moe is None or wrong:
            from tessera.common.errors import UserError

            raise UserError(f"model config: moe {wrong or None} has no {self.hf_class} equivalent (Mixtral routes "
                            "softmax top-k, renormalised, on every layer, experts as wide as intermediate_size)")
