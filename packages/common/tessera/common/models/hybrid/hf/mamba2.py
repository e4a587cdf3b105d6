"""Mamba2 (transformers' `Mamba2ForCausalLM`) <-> Tessera's hybrid kind, and the Mamba-2 mixer's
tensor mapping Nemotron-H shares.

Facts (transformers 5's modeling and configuration files; the parity tests compare logits, loss
and saved bytes with transformers): every layer is a Mamba-2 mixer (pattern all `M`); tensors are
saved under `backbone.` (`embeddings`, `layers.<i>.norm`, `layers.<i>.mixer.*`, `norm_f`) and
`lm_head.weight`, which a tied model does not save. The mixer fuses what Tessera stores split:
`in_proj.weight` rows are [z | x | B | C | dt] and `conv1d.weight` [channels, 1, K] rows
[x | B | C]. The inner width is expand x hidden_size and must equal num_heads x head_dim.
`time_step_limit` clamps the step; time_step_min / max / floor only initialise dt_bias;
time_step_rank is unused by the model (written as transformers derives it).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from tessera.common.errors import UserError
from tessera.common.hf.architecture import HEAD, HFArchitecture, HFConfig, prefix_of
from tessera.common.hf.rules import Rule, cat, inverse
from tessera.common.models.hybrid.config import HybridConfig, MambaConfig

PREFIX = "backbone."  # where transformers saves the base model of both families
_INFINITY = {"__float__": "Infinity"}  # how transformers 5 writes an infinite float in config.json


def time_step_limit(c: HFConfig, key: str = "time_step_limit") -> tuple[float, float | None]:
    """(low, high or None for no limit) from [low, high], high written as transformers 5 does
    ({"__float__": "Infinity"}) or as a bare number (older files wrote Infinity)."""
    value = c.data.get(key, [0.0, math.inf])
    if isinstance(value, list) and len(value) == 2 and value[1] == _INFINITY:
        value = [value[0], math.inf]
    if (not isinstance(value, list) or len(value) != 2
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)
            or not 0 <= value[0] <= value[1]):
        c.fail(key, f"must be [low, high] with 0 <= low <= high, got {value!r}")
    return float(value[0]), None if math.isinf(value[1]) else float(value[1])


def time_step_limit_to_hf(low: float, high: float | None) -> list[Any]:
    return [low, _INFINITY if high is None else high]


def mamba_fields(c: HFConfig, heads: str, head_dim: str, state: str, act: str) -> dict[str, Any]:
    """MambaConfig fields shared by both families (the keys that differ are named by the caller)."""
    c.require(act, c.text(act, "silu"), ("silu",), "the Mamba-2 mixer's activation is SiLU")
    return dict(num_heads=c.integer(heads), head_dim=c.integer(head_dim), state_size=c.integer(state),
                num_groups=c.integer("n_groups"), conv_kernel=c.integer("conv_kernel", 4),
                conv_bias=c.flag("use_conv_bias", True), bias=c.flag("use_bias", False),
                chunk_size=c.integer("chunk_size"), dt_min=c.number("time_step_min", 0.001, positive=True),
                dt_max=c.number("time_step_max", 0.1, positive=True),
                dt_init_floor=c.number("time_step_floor", 1e-4, positive=True))


def mamba_hf_fields(m: MambaConfig) -> dict[str, Any]:
    return {"n_groups": m.num_groups, "conv_kernel": m.conv_kernel, "use_conv_bias": m.conv_bias,
            "use_bias": m.bias, "chunk_size": m.chunk_size, "time_step_min": m.dt_min, "time_step_max": m.dt_max,
            "time_step_floor": m.dt_init_floor}


def mixer_rules(m: MambaConfig, d: int, t: str, h: str) -> list[Rule]:
    """Export rules of one Mamba-2 mixer (t: Tessera prefix, h: transformers prefix)."""
    widths = {"z": m.inner_size, "x": m.inner_size, "b": m.group_width, "c": m.group_width, "dt": m.num_heads}
    conv = {k: widths[k] for k in ("x", "b", "c")}
    k_taps = m.conv_kernel

    def fused(theirs: str, ours: str, parts: dict[str, int], suffix: str, tail: tuple[int, ...]) -> Rule:
        return Rule(h + f"{theirs}.{suffix}", tuple(t + f"{ours}.{k}.{suffix}" for k in parts),
                    (sum(parts.values()), *tail), cat, tuple((w, *tail) for w in parts.values()))

    rules = [fused("in_proj", "in_proj", widths, "weight", (d,)), fused("conv1d", "conv", conv, "weight", (1, k_taps))]
    if m.bias:
        rules.append(fused("in_proj", "in_proj", widths, "bias", ()))
    if m.conv_bias:
        rules.append(fused("conv1d", "conv", conv, "bias", ()))
    for name in ("dt_bias", "A_log", "D"):
        rules.append(Rule(h + name, (t + name,), (m.num_heads,)))
    rules.append(Rule(h + "norm.weight", (t + "norm.weight",), (m.inner_size,)))
    rules.append(Rule(h + "out_proj.weight", (t + "out_proj.weight",), (d, m.inner_size)))
    if m.bias:
        rules.append(Rule(h + "out_proj.bias", (t + "out_proj.bias",), (d,)))
    return rules


class HybridArchitecture(HFArchitecture):
    """What both families share: embedding, per-layer norm and mixer, final norm, head."""

    def layer_rules(self, cfg: HybridConfig, i: int, t: str, h: str) -> list[Rule]:
        raise NotImplementedError

    def export_rules(self, cfg: HybridConfig) -> list[Rule]:
        d = cfg.hidden_size
        rules = [Rule(PREFIX + "embeddings.weight", ("embed_tokens.weight",), (cfg.vocab_size, d))]
        for i in range(cfg.num_layers):
            t, h = f"layers.{i}.", PREFIX + f"layers.{i}."
            rules.append(Rule(h + "norm.weight", (t + "norm.weight",), (d,)))
            rules.extend(self.layer_rules(cfg, i, t + "mixer.", h + "mixer."))
        rules.append(Rule(PREFIX + "norm_f.weight", ("final_norm.weight",), (d,)))
        if not cfg.tie_embeddings:
            rules.append(Rule(HEAD, ("lm_head.weight",), (cfg.vocab_size, d)))
        return rules

    def import_rules(self, cfg: HybridConfig, hf_names: set[str]) -> list[Rule]:
        rules = inverse(self.export_rules(cfg))
        if prefix_of(hf_names, PREFIX):
            return rules
        return [replace(r, sources=tuple(s.removeprefix(PREFIX) for s in r.sources)) for r in rules]


class Mamba2(HybridArchitecture):
    model_type, hf_class, arch = "mamba2", "Mamba2ForCausalLM", "mamba2"

    def config_fields(self, c: HFConfig) -> dict[str, Any]:
        d, layers = c.integer("hidden_size"), c.integer("num_hidden_layers")
        mamba = mamba_fields(c, "num_heads", "head_dim", "state_size", "hidden_act")
        inner = mamba["num_heads"] * mamba["head_dim"]
        if int(c.integer("expand", 2) * d) != inner:
            c.fail("expand", f"x hidden_size ({c.data.get('expand')} x {d}) must equal num_heads x head_dim ({inner})")
        low, high = time_step_limit(c)
        return dict(vocab_size=c.integer("vocab_size"), hidden_size=d, num_layers=layers, pattern="M" * layers,
                    norm_eps=c.number("layer_norm_epsilon", 1e-5, positive=True),
                    mamba={**mamba, "dt_limit_min": low, "dt_limit_max": high},
                    tie_embeddings=c.flag("tie_word_embeddings", False),
                    residual_in_fp32=c.flag("residual_in_fp32", True),
                    init_std=c.number("initializer_range", 0.1, positive=True))

    def hf_fields(self, cfg: HybridConfig) -> dict[str, Any]:
        m = cfg.mamba
        assert m is not None
        return {"hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_layers, "num_heads": m.num_heads,
                "head_dim": m.head_dim, "state_size": m.state_size, "expand": m.inner_size // cfg.hidden_size,
                "hidden_act": "silu", **mamba_hf_fields(m),
                "time_step_limit": time_step_limit_to_hf(m.dt_limit_min, m.dt_limit_max),
                "time_step_rank": math.ceil(cfg.hidden_size / 16), "layer_norm_epsilon": cfg.norm_eps,
                "residual_in_fp32": cfg.residual_in_fp32, "rescale_prenorm_residual": False}

    def check_exportable(self, cfg: HybridConfig) -> None:
        if set(cfg.pattern) != {"M"}:
            raise UserError(f"model config: pattern={cfg.pattern!r} has no {self.hf_class} equivalent (every layer of "
                            "Mamba2 is a Mamba-2 mixer: all M)")
        m = cfg.mamba
        assert m is not None
        if m.inner_size % cfg.hidden_size:
            raise UserError(f"model config: mamba.num_heads x mamba.head_dim ({m.inner_size}) is not a whole multiple "
                            f"of hidden_size ({cfg.hidden_size}); {self.hf_class} sizes it as expand x hidden_size")

    def layer_rules(self, cfg: HybridConfig, i: int, t: str, h: str) -> list[Rule]:
        assert cfg.mamba is not None
        return mixer_rules(cfg.mamba, cfg.hidden_size, t, h)
