"""Mistral (transformers' `MistralForCausalLM`) <-> Tessera.

Llama's layout without biases, plus `sliding_window` on every layer (each query sees the last
`sliding_window` positions, itself included) and an explicit `head_dim`.
"""

from __future__ import annotations

from typing import Any

from tessera.common.hf.architecture import HFConfig
from tessera.common.models.causal_lm.config import ModelConfig
from tessera.common.models.causal_lm.hf.llama import LlamaFamily, sliding_from_hf


class Mistral(LlamaFamily):
    model_type, hf_class, arch = "mistral", "MistralForCausalLM", "mistral"

    def config_fields(self, c: HFConfig) -> dict[str, Any]:
        fields = self.common_fields(c)
        return {**fields, **sliding_from_hf(c, fields["num_layers"], qwen=False)}

    def hf_fields(self, cfg: ModelConfig) -> dict[str, Any]:
        return {**self.common_hf_fields(cfg), "sliding_window": cfg.sliding_window}

    def check_exportable(self, cfg: ModelConfig) -> None:
        super().check_exportable(cfg)
        self._refuse_fields(cfg, {"bias": False, "attention_bias": None, "sliding_window_layers": None, "moe": None},
                            "Mistral has no biases or experts and windows every layer alike")
