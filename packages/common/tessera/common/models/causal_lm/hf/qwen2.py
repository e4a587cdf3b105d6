"""Qwen2 / Qwen2.5 (transformers' `Qwen2ForCausalLM`) <-> Tessera.

Llama's layout with biases on q, k and v only (always; o and the MLP have none), and an optional
sliding window on the layers from `max_window_layers` on (`use_sliding_window`), or as listed by
`layer_types`.
"""

from __future__ import annotations

from typing import Any

from tessera.common.hf.architecture import HFConfig
from tessera.common.models.causal_lm.config import ModelConfig
from tessera.common.models.causal_lm.hf.llama import LlamaFamily, sliding_from_hf, sliding_to_hf

QKV = ["q", "k", "v"]


def qwen_sliding_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    windowed = [i for i in range(cfg.num_layers) if cfg.window(i)]
    return {**sliding_to_hf(cfg), "use_sliding_window": bool(windowed),
            "max_window_layers": windowed[0] if windowed else cfg.num_layers}


class Qwen2(LlamaFamily):
    model_type, hf_class, arch = "qwen2", "Qwen2ForCausalLM", "qwen2"

    def config_fields(self, c: HFConfig) -> dict[str, Any]:
        fields = self.common_fields(c)
        return {**fields, "attention_bias": QKV, **sliding_from_hf(c, fields["num_layers"], qwen=True)}

    def hf_fields(self, cfg: ModelConfig) -> dict[str, Any]:
        return {**self.common_hf_fields(cfg), **qwen_sliding_to_hf(cfg)}

    def check_exportable(self, cfg: ModelConfig) -> None:
        super().check_exportable(cfg)
        self._refuse_fields(cfg, {"bias": False, "attention_bias": QKV, "moe": None},
                            "Qwen2 has biases on q, k and v only, and no experts")
