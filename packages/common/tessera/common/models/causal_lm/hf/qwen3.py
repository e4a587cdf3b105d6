"""Qwen3 (transformers' `Qwen3ForCausalLM`) <-> Tessera.

Llama's layout with RMSNorm on each query and key head before RoPE (`self_attn.q_norm` /
`k_norm`, [head_dim]), an explicit `head_dim` (often not hidden / heads), `attention_bias` on
q/k/v/o together, and Qwen2's optional sliding window.
"""

from __future__ import annotations

from typing import Any

from tessera.common.errors import UserError
from tessera.common.hf.architecture import HFConfig
from tessera.common.models.causal_lm.config import ModelConfig
from tessera.common.models.causal_lm.hf.llama import LlamaFamily, sliding_from_hf
from tessera.common.models.causal_lm.hf.qwen2 import qwen_sliding_to_hf


class Qwen3(LlamaFamily):
    model_type, hf_class, arch = "qwen3", "Qwen3ForCausalLM", "qwen3"
    qk_norm = True

    def config_fields(self, c: HFConfig) -> dict[str, Any]:
        fields = self.common_fields(c)
        biased = ["q", "k", "v", "o"] if c.flag("attention_bias", False) else None
        return {**fields, "attention_bias": biased, **sliding_from_hf(c, fields["num_layers"], qwen=True)}

    def hf_fields(self, cfg: ModelConfig) -> dict[str, Any]:
        return {**self.common_hf_fields(cfg), "attention_bias": cfg.attn_bias("q"), **qwen_sliding_to_hf(cfg)}

    def check_exportable(self, cfg: ModelConfig) -> None:
        super().check_exportable(cfg)
        self._refuse_fields(cfg, {"bias": False}, f"{self.hf_class}'s MLP has no biases")
        if len({cfg.attn_bias(p) for p in "qkvo"}) > 1:
            raise UserError(f"model config: attention_bias={cfg.attention_bias} has no {self.hf_class} equivalent "
                            "(its attention_bias covers q, k, v and o together)")
        if cfg.moe is not None and self.model_type == "qwen3":
            raise UserError("model config: moe is set; export it as arch=qwen3_moe")
