"""Llama (transformers' `LlamaForCausalLM`) <-> Tessera.

Facts (transformers' modelling code is the reference; the parity tests compare logits and greedy
generations with transformers): names map one to one; q/k/v/o, gate/up/down are [out, in] like
ours; RoPE uses the same rotate-half layout, so no row permutation. Biases: `attention_bias`
covers q/k/v/o, `mlp_bias` gate/up/down (Tessera has one flag, so the two must agree). A tied
model stores no lm_head (transformers ignores one if present, and so do we).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from tessera.common.hf.architecture import HEAD, HFArchitecture, HFConfig, prefix_of
from tessera.common.hf.rules import Rule, inverse
from tessera.common.model_config import ModelConfig, RopeScaling


def rope_from_hf(c: HFConfig) -> tuple[float, RopeScaling | None]:
    """RoPE base and scaling, from either spelling: transformers >= 5 writes `rope_parameters`
    ({rope_type, rope_theta, factor, ...}); older versions wrote top-level `rope_theta` and
    `rope_scaling` ({rope_type or type, factor, ...}). When both are present `rope_parameters`
    wins, as it does in transformers 5. Shared by every RoPE family."""
    params = c.obj("rope_parameters")
    if params is not None:
        theta = params.number("rope_theta", c.number("rope_theta", 10000.0, positive=True), positive=True)
        scaling: HFConfig | None = params
    else:
        theta = c.number("rope_theta", 10000.0, positive=True)
        scaling = c.obj("rope_scaling")
    if scaling is None:
        return theta, None
    kind = scaling.text("rope_type", None) or scaling.text("type", "default")
    if kind == "default":
        return theta, None
    scaling.require("rope_type", kind, ("default", "llama3"), "Tessera implements default and llama3 RoPE")
    return theta, RopeScaling(
        factor=scaling.number("factor", positive=True),
        low_freq_factor=scaling.number("low_freq_factor", positive=True),
        high_freq_factor=scaling.number("high_freq_factor", positive=True),
        original_max_position_embeddings=scaling.integer("original_max_position_embeddings"))


def rope_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """Both spellings: `rope_parameters` for transformers >= 5 (which prefers it), and the
    top-level `rope_theta` / `rope_scaling` that older transformers, vLLM and TensorRT-LLM read."""
    scaling = cfg.rope_scaling.model_dump() if cfg.rope_scaling else None
    return {"rope_parameters": {**(scaling or {"rope_type": "default"}), "rope_theta": cfg.rope_theta},
            "rope_theta": cfg.rope_theta, "rope_scaling": scaling}


class Llama(HFArchitecture):
    model_type, hf_class, arch = "llama", "LlamaForCausalLM", "llama"

    def config_fields(self, c: HFConfig) -> dict[str, Any]:
        c.require("hidden_act", c.text("hidden_act", "silu"), ("silu",), "Llama's MLP is SwiGLU")
        attention_bias, mlp_bias = c.flag("attention_bias", False), c.flag("mlp_bias", False)
        if attention_bias != mlp_bias:
            c.fail("mlp_bias", f"= {mlp_bias} differs from attention_bias = {attention_bias}; Tessera has one "
                   "bias flag for both")
        d, heads = c.integer("hidden_size"), c.integer("num_attention_heads")
        head_dim = c.integer("head_dim", None)
        if head_dim is not None and head_dim * heads != d:
            c.fail("head_dim", f"= {head_dim} is not hidden_size / num_attention_heads ({d} / {heads}); not supported")
        theta, scaling = rope_from_hf(c)
        return dict(
            vocab_size=c.integer("vocab_size"), hidden_size=d, num_layers=c.integer("num_hidden_layers"),
            num_heads=heads, num_kv_heads=c.integer("num_key_value_heads", heads),
            ffn_hidden_size=c.integer("intermediate_size"), max_seq_len=c.integer("max_position_embeddings", 2048),
            norm="rmsnorm", norm_eps=c.number("rms_norm_eps", 1e-6, positive=True), activation="swiglu",
            position="rope", rope_theta=theta, rope_scaling=scaling, bias=attention_bias,
            tie_embeddings=c.flag("tie_word_embeddings", False),
            attention_dropout=c.number("attention_dropout", 0.0), init_std=c.number("initializer_range", 0.02, positive=True))

    def hf_fields(self, cfg: ModelConfig) -> dict[str, Any]:
        return {
            "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.ffn_hidden_size,
            "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_heads,
            "num_key_value_heads": cfg.kv_heads,
            "head_dim": cfg.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": cfg.max_seq_len,
            "rms_norm_eps": cfg.norm_eps,
            **rope_to_hf(cfg),
            "attention_bias": cfg.bias,
            "mlp_bias": cfg.bias,
            "attention_dropout": cfg.attention_dropout,
            "pretraining_tp": 1,
        }

    def check_exportable(self, cfg: ModelConfig) -> None:
        self._refuse_fields(cfg, {"norm": "rmsnorm", "activation": "swiglu", "position": "rope"},
                            "needs norm=rmsnorm, activation=swiglu, position=rope")

    def export_rules(self, cfg: ModelConfig) -> list[Rule]:
        d, f, v = cfg.hidden_size, cfg.ffn_hidden_size, cfg.vocab_size
        rules = [Rule("model.embed_tokens.weight", ("embed_tokens.weight",), (v, d))]
        for i in range(cfg.num_layers):
            t, h = f"layers.{i}.", f"model.layers.{i}."
            rules.append(Rule(h + "input_layernorm.weight", (t + "attn_norm.weight",), (d,)))
            for proj, out_dim, in_dim in (("q_proj", cfg.q_size, d), ("k_proj", cfg.kv_size, d),
                                          ("v_proj", cfg.kv_size, d), ("o_proj", d, cfg.q_size)):
                rules.append(Rule(h + f"self_attn.{proj}.weight", (t + f"attn.{proj}.weight",), (out_dim, in_dim)))
                if cfg.bias:
                    rules.append(Rule(h + f"self_attn.{proj}.bias", (t + f"attn.{proj}.bias",), (out_dim,)))
            rules.append(Rule(h + "post_attention_layernorm.weight", (t + "mlp_norm.weight",), (d,)))
            for proj, out_dim, in_dim in (("gate_proj", f, d), ("up_proj", f, d), ("down_proj", d, f)):
                rules.append(Rule(h + f"mlp.{proj}.weight", (t + f"mlp.{proj}.weight",), (out_dim, in_dim)))
                if cfg.bias:
                    rules.append(Rule(h + f"mlp.{proj}.bias", (t + f"mlp.{proj}.bias",), (out_dim,)))
        rules.append(Rule("model.norm.weight", ("final_norm.weight",), (d,)))
        if not cfg.tie_embeddings:
            rules.append(Rule(HEAD, ("lm_head.weight",), (v, d)))
        return rules

    def import_rules(self, cfg: ModelConfig, hf_names: set[str]) -> list[Rule]:
        # Names map one to one with identical shapes: invert the export rules.
        rules = inverse(self.export_rules(cfg))
        if prefix_of(hf_names, "model."):
            return rules
        return [replace(r, sources=tuple(s.removeprefix("model.") for s in r.sources)) for r in rules]
