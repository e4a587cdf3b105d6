"""Llama (transformers' `LlamaForCausalLM`) <-> Tessera, and `LlamaFamily`, the base of every
family built on Llama's layout (Mistral, Qwen2, Qwen3, Mixtral, Qwen3-MoE: one module each).

Facts (transformers' modelling code is the reference; the parity tests compare logits and greedy
generations with transformers): names map one to one; q/k/v/o, gate/up/down are [out, in] like
ours; RoPE uses the same rotate-half layout, so no row permutation. Biases: `attention_bias`
covers q/k/v/o, `mlp_bias` gate/up/down. A tied model stores no lm_head (transformers ignores
one if present, and so do we). Explicit `head_dim` is read and written by every family.
Experts (Mixtral, Qwen3-MoE) are stored one tensor per expert, as transformers 5 still saves
them; Tessera stacks them ([E, out, in]).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from tessera.common.errors import UserError
from tessera.common.hf.architecture import HEAD, HFArchitecture, HFConfig, prefix_of
from tessera.common.hf.rules import Rule, inverse, zeros
from tessera.common.models.causal_lm.config import (
    DynamicRopeScaling,
    LinearRopeScaling,
    ModelConfig,
    RopeScaling,
    YarnRopeScaling,
)


def rope_from_hf(c: HFConfig) -> tuple[float, Any]:
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
    scaling.require("rope_type", kind, ("default", "linear", "dynamic", "yarn", "llama3"),
                    "Tessera implements default, linear, dynamic, yarn and llama3 RoPE")
    factor = scaling.number("factor", positive=True)
    max_pos = c.integer("max_position_embeddings", 2048)
    if kind == "linear":
        return theta, LinearRopeScaling(rope_type="linear", factor=factor)
    if kind == "dynamic":  # transformers scales relative to max_position_embeddings
        return theta, DynamicRopeScaling(rope_type="dynamic", factor=factor, original_max_position_embeddings=max_pos)
    original = scaling.integer("original_max_position_embeddings", max_pos)
    if kind == "yarn":
        return theta, YarnRopeScaling(
            rope_type="yarn", factor=factor, original_max_position_embeddings=original,
            beta_fast=scaling.number("beta_fast", 32.0, positive=True),
            beta_slow=scaling.number("beta_slow", 1.0, positive=True),
            attention_factor=scaling.number("attention_factor", None, positive=True),
            mscale=scaling.number("mscale", None), mscale_all_dim=scaling.number("mscale_all_dim", None),
            truncate=scaling.flag("truncate", True))
    return theta, RopeScaling(
        factor=factor,
        low_freq_factor=scaling.number("low_freq_factor", positive=True),
        high_freq_factor=scaling.number("high_freq_factor", positive=True),
        original_max_position_embeddings=original)


def max_positions(cfg: ModelConfig) -> int:
    """config.json's max_position_embeddings: the dynamic-NTK reference length, else max_seq_len."""
    s = cfg.rope_scaling
    return s.original_max_position_embeddings if isinstance(s, DynamicRopeScaling) else cfg.max_seq_len


def rope_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """Both spellings: `rope_parameters` for transformers >= 5 (which prefers it), and the
    top-level `rope_theta` / `rope_scaling` that older transformers, vLLM and TensorRT-LLM read."""
    scaling = None
    if cfg.rope_scaling is not None:
        scaling = cfg.rope_scaling.model_dump(exclude_none=True)
        if isinstance(cfg.rope_scaling, DynamicRopeScaling):
            del scaling["original_max_position_embeddings"]  # it is max_position_embeddings
    return {"rope_parameters": {**(scaling or {"rope_type": "default"}), "rope_theta": cfg.rope_theta},
            "rope_theta": cfg.rope_theta, "rope_scaling": scaling}


def sliding_from_hf(c: HFConfig, num_layers: int, qwen: bool) -> dict[str, Any]:
    """sliding_window / sliding_window_layers from `sliding_window` (Mistral: every layer), Qwen's
    `use_sliding_window` + `max_window_layers`, or an explicit `layer_types` list."""
    window = c.integer("sliding_window", None)
    if qwen and not c.flag("use_sliding_window", False):
        window = None
    types = c.data.get("layer_types")
    if window is None:
        if isinstance(types, list) and "sliding_attention" in types:
            c.fail("layer_types", "lists sliding_attention layers but no sliding window is in use")
        return {}
    if isinstance(types, list):
        if len(types) != num_layers or not set(types) <= {"sliding_attention", "full_attention"}:
            c.fail("layer_types", f"must list full_attention / sliding_attention for each of {num_layers} layers")
        layers = [i for i, t in enumerate(types) if t == "sliding_attention"]
    elif qwen:
        layers = list(range(c.integer("max_window_layers", 28, positive=False), num_layers))
    else:
        layers = list(range(num_layers))
    if not layers:
        return {}
    return {"sliding_window": window, "sliding_window_layers": None if len(layers) == num_layers else layers}


def sliding_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    types = ["sliding_attention" if cfg.window(i) else "full_attention" for i in range(cfg.num_layers)]
    return {"sliding_window": cfg.sliding_window, "layer_types": types}


def _stack(ts: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack(ts)


def _expert(e: int):
    return lambda ts: ts[0][e]


class LlamaFamily(HFArchitecture):
    """Llama's layout with the hooks its descendants change (attention biases, q/k norm, sliding
    window, experts). Subclasses set the names, `config_fields` extras and `hf_fields` extras."""

    qk_norm = False
    expert_prefix = "mlp."  # where a sparse layer's router and experts live
    router_name = "gate"
    expert_names = ("gate_proj", "up_proj", "down_proj")  # transformers' names for our gate/up/down

    def common_fields(self, c: HFConfig) -> dict[str, Any]:
        c.require("hidden_act", c.text("hidden_act", "silu"), ("silu",), f"{self.hf_class}'s MLP is SwiGLU")
        d, heads = c.integer("hidden_size"), c.integer("num_attention_heads")
        theta, scaling = rope_from_hf(c)
        max_len = c.integer("max_position_embeddings", 2048)
        if isinstance(scaling, DynamicRopeScaling):
            max_len = int(max_len * scaling.factor)  # dynamic NTK exists to run past it
        return dict(
            vocab_size=c.integer("vocab_size"), hidden_size=d, num_layers=c.integer("num_hidden_layers"),
            num_heads=heads, num_kv_heads=c.integer("num_key_value_heads", heads), head_dim=c.integer("head_dim", None),
            ffn_hidden_size=c.integer("intermediate_size"), max_seq_len=max_len,
            norm="rmsnorm", norm_eps=c.number("rms_norm_eps", 1e-6, positive=True), activation="swiglu",
            position="rope", rope_theta=theta, rope_scaling=scaling, qk_norm=self.qk_norm,
            tie_embeddings=c.flag("tie_word_embeddings", False),
            attention_dropout=c.number("attention_dropout", 0.0), init_std=c.number("initializer_range", 0.02, positive=True))

    def common_hf_fields(self, cfg: ModelConfig) -> dict[str, Any]:
        return {
            "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.ffn_hidden_size,
            "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_heads,
            "num_key_value_heads": cfg.kv_heads,
            "head_dim": cfg.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": max_positions(cfg),
            "rms_norm_eps": cfg.norm_eps,
            **rope_to_hf(cfg),
            "attention_dropout": cfg.attention_dropout,
        }

    def check_exportable(self, cfg: ModelConfig) -> None:
        self._refuse_fields(cfg, {"norm": "rmsnorm", "activation": "swiglu", "position": "rope",
                                  "qk_norm": self.qk_norm},
                            f"needs norm=rmsnorm, activation=swiglu, position=rope, qk_norm={self.qk_norm}")

    def mlp_rules(self, cfg: ModelConfig, i: int, t: str, h: str) -> list[Rule]:
        """Export rules of layer i's MLP (t: Tessera prefix, h: transformers prefix)."""
        d, f = cfg.hidden_size, cfg.ffn_hidden_size
        rules = []
        if cfg.is_moe_layer(i):
            moe = cfg.moe
            assert moe is not None
            fe, e_count, p = moe.ffn_hidden_size, moe.num_experts, h + self.expert_prefix
            rules.append(Rule(p + f"{self.router_name}.weight", (t + "mlp.router.weight",), (e_count, d)))
            for e in range(e_count):
                for ours, theirs, shape in zip(("gate_proj", "up_proj", "down_proj"), self.expert_names,
                                               ((fe, d), (fe, d), (d, fe))):
                    rules.append(Rule(p + f"experts.{e}.{theirs}.weight", (t + f"mlp.experts.{ours}",), shape,
                                      _expert(e), ((e_count, *shape),)))
            return rules
        for proj, out_dim, in_dim in (("gate_proj", f, d), ("up_proj", f, d), ("down_proj", d, f)):
            rules.append(Rule(h + f"mlp.{proj}.weight", (t + f"mlp.{proj}.weight",), (out_dim, in_dim)))
            if cfg.bias:
                rules.append(Rule(h + f"mlp.{proj}.bias", (t + f"mlp.{proj}.bias",), (out_dim,)))
        return rules

    def export_rules(self, cfg: ModelConfig) -> list[Rule]:
        d, v = cfg.hidden_size, cfg.vocab_size
        rules = [Rule("model.embed_tokens.weight", ("embed_tokens.weight",), (v, d))]
        for i in range(cfg.num_layers):
            t, h = f"layers.{i}.", f"model.layers.{i}."
            rules.append(Rule(h + "input_layernorm.weight", (t + "attn_norm.weight",), (d,)))
            for proj, out_dim, in_dim in (("q_proj", cfg.q_size, d), ("k_proj", cfg.kv_size, d),
                                          ("v_proj", cfg.kv_size, d), ("o_proj", d, cfg.q_size)):
                rules.append(Rule(h + f"self_attn.{proj}.weight", (t + f"attn.{proj}.weight",), (out_dim, in_dim)))
                if cfg.attn_bias(proj[0]):
                    rules.append(Rule(h + f"self_attn.{proj}.bias", (t + f"attn.{proj}.bias",), (out_dim,)))
            if cfg.qk_norm:
                for norm in ("q_norm", "k_norm"):
                    rules.append(Rule(h + f"self_attn.{norm}.weight", (t + f"attn.{norm}.weight",), (cfg.head_dim,)))
            rules.append(Rule(h + "post_attention_layernorm.weight", (t + "mlp_norm.weight",), (d,)))
            rules.extend(self.mlp_rules(cfg, i, t, h))
        rules.append(Rule("model.norm.weight", ("final_norm.weight",), (d,)))
        if not cfg.tie_embeddings:
            rules.append(Rule(HEAD, ("lm_head.weight",), (v, d)))
        return rules

    def import_rules(self, cfg: ModelConfig, hf_names: set[str]) -> list[Rule]:
        rules = []
        by_target: dict[str, list[Rule]] = {}
        for r in self.export_rules(cfg):
            if r.combine is None:  # a rename: invert it
                rules.extend(inverse([r]))
            else:  # one expert of a stacked tensor: gather all of them into one stack rule
                by_target.setdefault(r.sources[0], []).append(r)
        for target, parts in by_target.items():
            rules.append(Rule(target, tuple(p.target for p in parts), parts[0].source_shapes[0], _stack,
                              tuple(p.shape for p in parts)))
        for i in range(cfg.num_layers):  # the balancing bias: none in transformers (export refuses one)
            if cfg.is_moe_layer(i) and cfg.moe is not None:
                shape = (cfg.moe.num_experts,)
                rules.append(Rule(f"layers.{i}.mlp.expert_bias", (), shape, zeros(shape)))
        if prefix_of(hf_names, "model."):
            return rules
        return [replace(r, sources=tuple(s.removeprefix("model.") for s in r.sources)) for r in rules]


class Llama(LlamaFamily):
    model_type, hf_class, arch = "llama", "LlamaForCausalLM", "llama"

    def config_fields(self, c: HFConfig) -> dict[str, Any]:
        attention_bias, mlp_bias = c.flag("attention_bias", False), c.flag("mlp_bias", False)
        biased = ["q", "k", "v", "o"] if attention_bias else []
        return {**self.common_fields(c), "bias": mlp_bias,
                "attention_bias": None if attention_bias == mlp_bias else biased}

    def hf_fields(self, cfg: ModelConfig) -> dict[str, Any]:
        return {**self.common_hf_fields(cfg), "attention_bias": cfg.attn_bias("q"), "mlp_bias": cfg.bias,
                "pretraining_tp": 1}

    def check_exportable(self, cfg: ModelConfig) -> None:
        super().check_exportable(cfg)
        biases = {cfg.attn_bias(p) for p in "qkvo"}
        if len(biases) > 1:
            raise UserError(f"model config: attention_bias={cfg.attention_bias} has no {self.hf_class} equivalent "
                            "(its attention_bias covers q, k, v and o together)")
        self._refuse_fields(cfg, {"sliding_window": None, "moe": None}, "Llama has no sliding window or experts")
