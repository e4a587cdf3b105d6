"""Nemotron-H (transformers' `NemotronHForCausalLM`) <-> Tessera's hybrid kind.

Facts (transformers 5's modeling and configuration files; the parity tests compare logits, loss
and saved bytes with transformers):
- Layers: `layers_block_type` lists linear_attention (M), full_attention (*), mlp (-), moe (E)
  (legacy names mamba / attention; older files give `hybrid_override_pattern`, Megatron's string,
  and the mixer's settings as mamba_n_groups, mamba_d_conv, mamba_conv_bias...: LEGACY_NAMES).
  Each layer is `norm` + `mixer`; tensors are saved under `backbone.` and `lm_head.weight`.
- Mamba mixer: Mamba2's (tessera.common.models.hybrid.hf.mamba2), with mamba_num_heads x
  mamba_head_dim inner channels (`expand` is not read) and the step clamped to
  [time_step_min, inf) (transformers' NemotronHMamba2Mixer; its `time_step_limit` is not read).
- Attention: q/k/v/o without biases whatever `attention_bias` says, no position embeddings.
  `sliding_window` is not applied by transformers; Tessera refuses one rather than guess.
- MLP: up/down with `mlp_bias`, activation `mlp_hidden_act` (relu2: squared ReLU, the one built).
- MoE: router `gate.weight` [E, d] and `gate.e_score_correction_bias` [E] (sigmoid scores, the
  bias added for selection only, grouped top-k over n_group / topk_group, renormalised when
  norm_topk_prob, times routed_scaling_factor); routed experts saved one tensor per expert
  (`experts.<e>.up_proj.weight` [f, d], `down_proj` [d, f]; transformers stacks them in memory),
  squared ReLU without a gate; a shared expert MLP (`shared_experts`, moe_shared_expert_
  intermediate_size wide) that transformers always builds. Tessera's MoE matches with
  score=sigmoid and bias_balancing (its expert_bias is e_score_correction_bias).
- Not built, refused: multi-token prediction layers (num_nextn_predict_layers > 0), a latent MoE
  projection (moe_latent_size), biases on the MLPs of MoE layers, tied embeddings (transformers'
  Nemotron-H never ties them, whatever tie_word_embeddings says).
- Read and written back but not used by the model: residual_in_fp32 (transformers does not apply
  it), rescale_prenorm_residual and the time-step initialisation fields, cache and kernel
  settings.
"""

from __future__ import annotations

from typing import Any

from tessera.common.errors import UserError
from tessera.common.hf.architecture import HFConfig
from tessera.common.hf.rules import Pick, Rule
from tessera.common.models.hybrid.config import HybridConfig
from tessera.common.models.hybrid.hf.mamba2 import (
    HybridArchitecture,
    mamba_fields,
    mamba_hf_fields,
    mixer_rules,
    time_step_limit_to_hf,
)

LAYER_TYPES = {"linear_attention": "M", "full_attention": "*", "mlp": "-", "moe": "E",
               "mamba": "M", "attention": "*"}  # the last two: legacy names transformers still reads
TYPE_NAMES = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
# The mixer's settings under their older names, which transformers' NemotronHConfig renames as it
# loads (the old name wins when both are present, as there).
LEGACY_NAMES = {"mamba_n_groups": "n_groups", "mamba_d_conv": "conv_kernel", "mamba_expand": "expand",
                "mamba_dt_min": "time_step_min", "mamba_dt_max": "time_step_max", "mamba_dt_limit": "time_step_limit",
                "mamba_dt_init_floor": "time_step_floor", "mamba_conv_bias": "use_conv_bias",
                "mamba_chunk_size": "chunk_size"}


def _pattern(c: HFConfig) -> str:
    types = c.data.get("layers_block_type")
    if types is None:
        pattern = c.text("hybrid_override_pattern", None)
        if pattern is None:
            c.fail("layers_block_type", "missing; not a complete nemotron_h config.json")
        return pattern
    if not isinstance(types, list) or not types or not all(t in LAYER_TYPES for t in types):
        c.fail("layers_block_type", f"must list {', '.join(TYPE_NAMES.values())} per layer, got {types!r}")
    return "".join(LAYER_TYPES[t] for t in types)


class NemotronH(HybridArchitecture):
    model_type, hf_class, arch = "nemotron_h", "NemotronHForCausalLM", "nemotron_h"

    def config_fields(self, c: HFConfig) -> dict[str, Any]:
        renamed = {new: c.data[old] for old, new in LEGACY_NAMES.items() if old in c.data}
        c = HFConfig({**c.data, **renamed}, c.source)
        pattern = _pattern(c)
        c.require("num_nextn_predict_layers", c.integer("num_nextn_predict_layers", 0, positive=False), (0,),
                  "multi-token prediction layers are not built")
        c.require("sliding_window", c.integer("sliding_window", None), (None,),
                  "transformers' Nemotron-H does not apply it")
        c.require("tie_word_embeddings", c.flag("tie_word_embeddings", False), (False,),
                  "transformers' Nemotron-H never ties the head to the embedding")
        d = c.integer("hidden_size")
        fields: dict[str, Any] = dict(
            vocab_size=c.integer("vocab_size"), hidden_size=d, num_layers=len(pattern), pattern=pattern,
            max_seq_len=c.integer("max_position_embeddings", 4096),
            norm_eps=c.number("layer_norm_epsilon", 1e-5, positive=True),
            init_std=c.number("initializer_range", 0.02, positive=True),
            attention_dropout=c.number("attention_dropout", 0.0))
        if "M" in pattern:
            mamba = mamba_fields(c, "mamba_num_heads", "mamba_head_dim", "ssm_state_size", "mamba_hidden_act")
            fields["mamba"] = {**mamba, "dt_limit_min": mamba["dt_min"], "dt_limit_max": None}
        if "*" in pattern:
            heads = c.integer("num_attention_heads")
            fields.update(num_heads=heads, num_kv_heads=c.integer("num_key_value_heads", heads),
                          head_dim=c.integer("head_dim", None))
        if "-" in pattern or "E" in pattern:
            c.require("mlp_hidden_act", c.text("mlp_hidden_act", "relu2"), ("relu2",),
                      "Tessera builds Nemotron-H's squared-ReLU MLPs")
        if "-" in pattern:
            fields.update(ffn_hidden_size=c.integer("intermediate_size"), mlp_bias=c.flag("mlp_bias", False))
        if "E" in pattern:
            c.require("moe_latent_size", c.integer("moe_latent_size", None), (None,),
                      "the latent MoE projection is not built")
            c.require("mlp_bias", c.flag("mlp_bias", False), (False,),
                      "the shared experts of Tessera's MoE have no biases")
            fields["moe"] = dict(
                num_experts=c.integer("n_routed_experts"), top_k=c.integer("num_experts_per_tok"),
                ffn_hidden_size=c.integer("moe_intermediate_size"), score="sigmoid",
                norm_topk_prob=c.flag("norm_topk_prob", True),
                routed_scaling_factor=c.number("routed_scaling_factor", 1.0, positive=True),
                num_shared_experts=c.integer("n_shared_experts", 1, positive=False),
                shared_ffn_hidden_size=c.integer("moe_shared_expert_intermediate_size"),
                num_groups=c.integer("n_group", 1), topk_groups=c.integer("topk_group", 1), bias_balancing=True)
        return fields

    def hf_fields(self, cfg: HybridConfig) -> dict[str, Any]:
        out: dict[str, Any] = {
            "hidden_size": cfg.hidden_size, "layers_block_type": [TYPE_NAMES[s] for s in cfg.pattern],
            "num_hidden_layers": cfg.num_layers, "max_position_embeddings": cfg.max_seq_len,
            "layer_norm_epsilon": cfg.norm_eps, "attention_dropout": cfg.attention_dropout,
            "attention_bias": False, "sliding_window": None, "mlp_hidden_act": "relu2", "mlp_bias": cfg.mlp_bias,
            "residual_in_fp32": False, "rescale_prenorm_residual": True, "hidden_dropout": 0.0,
            "num_nextn_predict_layers": 0, "mtp_layers_block_type": ["full_attention", "moe"],
            "num_logits_to_keep": 1, "use_mamba_kernels": True, "mamba_hidden_act": "silu",
            "mamba_proj_bias": False, "mamba_ssm_cache_dtype": "float32", "time_step_limit": time_step_limit_to_hf(0.0, None),
            "moe_latent_size": None, "moe_shared_expert_overlap": True, "output_router_logits": False,
        }
        m = cfg.mamba
        if m is not None:
            out.update({"mamba_num_heads": m.num_heads, "mamba_head_dim": m.head_dim, "ssm_state_size": m.state_size,
                        "expand": m.inner_size // cfg.hidden_size if m.inner_size % cfg.hidden_size == 0 else 2,
                        **mamba_hf_fields(m)})
        if cfg.num_heads is not None:
            out.update({"num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.kv_heads,
                        "head_dim": cfg.attention_head_dim})
        if cfg.ffn_hidden_size is not None:
            out["intermediate_size"] = cfg.ffn_hidden_size
        if cfg.moe is not None:
            moe = cfg.moe
            out.update({"n_routed_experts": moe.num_experts, "num_experts_per_tok": moe.top_k,
                        "moe_intermediate_size": moe.ffn_hidden_size, "norm_topk_prob": moe.norm_topk_prob,
                        "routed_scaling_factor": moe.routed_scaling_factor, "n_shared_experts": moe.num_shared_experts,
                        "moe_shared_expert_intermediate_size": moe.shared_size, "n_group": moe.num_groups,
                        "topk_group": moe.topk_groups})
        return out

    def check_exportable(self, cfg: HybridConfig) -> None:
        def refuse(field: str, why: str) -> None:
            raise UserError(f"model config: {field} has no {self.hf_class} equivalent ({why})")

        if cfg.tie_embeddings:
            refuse("tie_embeddings=true", "transformers' Nemotron-H never ties the head to the embedding")
        if cfg.residual_in_fp32:
            refuse("residual_in_fp32=true", "transformers' Nemotron-H keeps the residual in the model dtype")
        m = cfg.mamba
        if m is not None and (m.dt_limit_min != m.dt_min or m.dt_limit_max is not None):
            refuse(f"mamba.dt_limit_min={m.dt_limit_min}, dt_limit_max={m.dt_limit_max}",
                   "transformers' Nemotron-H clamps the step to [time_step_min, inf): set dt_limit_min = dt_min")
        moe = cfg.moe
        if moe is not None:
            want = dict(score="sigmoid", capacity_factor=None, aux_loss_coef=0.0)
            wrong = {k: getattr(moe, k) for k, v in want.items() if getattr(moe, k) != v}
            if wrong:
                refuse(f"moe {wrong}", "Nemotron-H routes by sigmoid scores, dropless, without an auxiliary loss")
            if not moe.shared_size:
                refuse("moe without shared experts", "every Nemotron-H MoE layer has a shared expert")
            if cfg.mlp_bias:
                refuse("mlp_bias=true with MoE layers", "Tessera's shared experts have no biases")

    def layer_rules(self, cfg: HybridConfig, i: int, t: str, h: str) -> list[Rule]:
        symbol, d = cfg.pattern[i], cfg.hidden_size
        if symbol == "M":
            assert cfg.mamba is not None
            return mixer_rules(cfg.mamba, d, t, h)
        if symbol == "*":
            q, kv = cfg.num_heads * cfg.attention_head_dim, cfg.kv_heads * cfg.attention_head_dim  # type: ignore[operator]
            return [Rule(h + f"{p}.weight", (t + f"{p}.weight",), shape)
                    for p, shape in (("q_proj", (q, d)), ("k_proj", (kv, d)), ("v_proj", (kv, d)), ("o_proj", (d, q)))]
        if symbol == "-":
            f = cfg.ffn_hidden_size
            assert f is not None
            rules = [Rule(h + "up_proj.weight", (t + "up_proj.weight",), (f, d)),
                     Rule(h + "down_proj.weight", (t + "down_proj.weight",), (d, f))]
            if cfg.mlp_bias:
                rules += [Rule(h + "up_proj.bias", (t + "up_proj.bias",), (f,)),
                          Rule(h + "down_proj.bias", (t + "down_proj.bias",), (d,))]
            return rules
        moe = cfg.moe
        assert moe is not None
        e_count, fe, fs = moe.num_experts, moe.ffn_hidden_size, moe.shared_size
        rules = [Rule(h + "gate.weight", (t + "router.weight",), (e_count, d)),
                 Rule(h + "gate.e_score_correction_bias", (t + "expert_bias",), (e_count,))]
        for e in range(e_count):
            rules += [Rule(h + f"experts.{e}.up_proj.weight", (t + "experts.up_proj",), (fe, d), Pick(e), ((e_count, fe, d),)),
                      Rule(h + f"experts.{e}.down_proj.weight", (t + "experts.down_proj",), (d, fe), Pick(e), ((e_count, d, fe),))]
        rules += [Rule(h + "shared_experts.up_proj.weight", (t + "shared.up_proj.weight",), (fs, d)),
                  Rule(h + "shared_experts.down_proj.weight", (t + "shared.down_proj.weight",), (d, fs))]
        return rules
