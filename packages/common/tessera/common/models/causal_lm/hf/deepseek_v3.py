"""DeepSeek-V3 (transformers' `DeepseekV3ForCausalLM`) <-> Tessera.

Facts (transformers' modelling code is the reference; the parity tests compare logits):
- attention is multi-head latent attention (`mla`): `self_attn.q_proj` or `q_a_proj` /
  `q_a_layernorm` / `q_b_proj`, `kv_a_proj_with_mqa` / `kv_a_layernorm` / `kv_b_proj`, `o_proj`;
  the latent norms' epsilon is transformers' fixed 1e-6. With `rope_interleave` (DeepSeek's
  default) the RoPE dimensions of each query head and of the shared key come as interleaved pairs;
  Tessera rotates halves, so import reorders those rows (evens then odds) and export restores them
  - exactly, so import -> export gives the same bytes.
- MLP: the first `first_k_dense_replace` layers dense (`intermediate_size`), the rest MoE:
  `mlp.gate.weight` (router), `mlp.gate.e_score_correction_bias` (Tessera's `expert_bias`),
  `mlp.experts.<e>.gate_proj/up_proj/down_proj`, `mlp.shared_experts.*` (n_shared_experts x
  moe_intermediate_size wide). Routing: sigmoid, group-limited top-k (`n_group`, `topk_group`),
  top-k weights renormalised when `norm_topk_prob`, times `routed_scaling_factor`.
- Imports train with DeepSeek-V3's auxiliary-loss-free balancing (bias_balancing, rate 1e-3);
  config.json has no field for it, nor for an aux-loss coefficient, so export does not carry them.
- Multi-token prediction (`mtp`): DeepSeek's checkpoints hold depth k as layer num_hidden_layers + k:
  a decoder layer's tensors plus `enorm`, `hnorm`, `eh_proj`, `shared_head.norm` (Tessera's
  `head_norm`) and copies of the embedding and output head (`embed_tokens`, `shared_head.head`),
  which Tessera shares with the main model: import does not read the copies, export writes the
  main ones there. transformers' model does not load these layers and writes
  `num_nextn_predict_layers: 1` without them, so import keeps the depths whose tensors are present
  (tessera.common.hf.directory.read_hf_config) and export writes the depth Tessera holds.
"""

from __future__ import annotations

from typing import Any

import torch

from tessera.common.errors import UserError
from tessera.common.hf.architecture import HEAD, HFConfig, prefix_of
from tessera.common.hf.rules import Rule, inverse
from tessera.common.models.causal_lm.config import ModelConfig
from tessera.common.models.causal_lm.hf.llama import LlamaFamily, _stack

# What a DeepSeek MTP layer stores of the embedding and head it shares with the main model.
_SHARED_COPIES = frozenset({"embed_tokens.weight", "shared_head.head.weight"})


def _rope_order(rope: int) -> torch.Tensor:
    """Interleaved pair layout -> rotate-half layout: evens then odds."""
    return torch.cat((torch.arange(0, rope, 2), torch.arange(1, rope, 2)))


class _Permute:
    """Reorder the RoPE rows of a weight: per head of `width` rows (rope rows starting at `start`)."""

    def __init__(self, width: int, start: int, rope: int, to_hf: bool):
        order = _rope_order(rope)
        self.index = torch.argsort(order) if to_hf else order
        self.width, self.start, self.rope = width, start, rope

    def __call__(self, ts: list[torch.Tensor]) -> torch.Tensor:
        w = ts[0]
        heads = w.view(-1, self.width, *w.shape[1:]).clone()
        part = slice(self.start, self.start + self.rope)
        heads[:, part] = heads[:, part][:, self.index]
        return heads.view_as(w)


class DeepseekV3(LlamaFamily):
    model_type, hf_class, arch = "deepseek_v3", "DeepseekV3ForCausalLM", "deepseek_v3"

    def config_fields(self, c: HFConfig) -> dict[str, Any]:
        c.require("attention_bias", c.flag("attention_bias", False), (False,), "Tessera's MLA has no biases")
        heads = c.integer("num_attention_heads")
        c.require("num_key_value_heads", c.integer("num_key_value_heads", heads), (heads,),
                  "latent attention expands keys and values for every head")
        fields = self.common_fields(c)
        rope = c.integer("qk_rope_head_dim")
        fields.update(num_kv_heads=None, head_dim=rope)
        fields["mla"] = dict(
            q_lora_rank=c.integer("q_lora_rank", None), kv_lora_rank=c.integer("kv_lora_rank"),
            qk_nope_head_dim=c.integer("qk_nope_head_dim"), qk_rope_head_dim=rope,
            v_head_dim=c.integer("v_head_dim"), rope_interleave=c.flag("rope_interleave", True))
        depth = c.integer("num_nextn_predict_layers", 0, positive=False)
        fields["mtp"] = dict(depth=depth) if depth else None
        fields["moe"] = dict(
            num_experts=c.integer("n_routed_experts"), top_k=c.integer("num_experts_per_tok"),
            ffn_hidden_size=c.integer("moe_intermediate_size"), score="sigmoid",
            norm_topk_prob=c.flag("norm_topk_prob", True),
            routed_scaling_factor=c.number("routed_scaling_factor", 1.0, positive=True),
            num_shared_experts=c.integer("n_shared_experts"), num_groups=c.integer("n_group", 1),
            topk_groups=c.integer("topk_group", 1), bias_balancing=True,
            first_k_dense=c.integer("first_k_dense_replace", 0, positive=False))
        return fields

    def hf_fields(self, cfg: ModelConfig) -> dict[str, Any]:
        m, moe = cfg.mla, cfg.moe
        assert m is not None and moe is not None
        return {**self.common_hf_fields(cfg), "attention_bias": False, "pretraining_tp": 1,
                "q_lora_rank": m.q_lora_rank, "kv_lora_rank": m.kv_lora_rank,
                "qk_nope_head_dim": m.qk_nope_head_dim, "qk_rope_head_dim": m.qk_rope_head_dim,
                "qk_head_dim": m.qk_head_dim, "v_head_dim": m.v_head_dim, "rope_interleave": m.rope_interleave,
                "n_routed_experts": moe.num_experts, "num_experts_per_tok": moe.top_k,
                "moe_intermediate_size": moe.ffn_hidden_size, "n_shared_experts": moe.num_shared_experts,
                "routed_scaling_factor": moe.routed_scaling_factor, "norm_topk_prob": moe.norm_topk_prob,
                "n_group": moe.num_groups, "topk_group": moe.topk_groups,
                "first_k_dense_replace": moe.first_k_dense,
                "num_nextn_predict_layers": cfg.mtp.depth if cfg.mtp is not None else 0,
                "output_router_logits": False}

    def check_exportable(self, cfg: ModelConfig) -> None:
        super().check_exportable(cfg)
        self._refuse_fields(cfg, {"sliding_window": None, "tie_embeddings": False},
                            "DeepSeek-V3 has no sliding window and an untied head")
        moe = cfg.moe
        if cfg.mla is None or moe is None:
            raise UserError(f"model config: arch=deepseek_v3 needs mla and moe (its {self.hf_class} has both)")
        want = dict(score="sigmoid", shared_ffn_hidden_size=None, capacity_factor=None, layer_freq=1)
        wrong = {k: getattr(moe, k) for k, v in want.items() if getattr(moe, k) != v}
        if wrong or moe.num_shared_experts < 1:
            raise UserError(f"model config: moe {wrong or {'num_shared_experts': 0}} has no {self.hf_class} "
                            "equivalent (sigmoid routing, >= 1 shared expert, every layer sparse after the first "
                            "dense ones)")

    def unread_names(self, cfg: ModelConfig, hf_names: set[str]) -> frozenset[str]:
        """DeepSeek's multi-token-prediction layers Tessera does not hold (model.layers.<num_hidden_layers
        + k>.* past its depth), and each held depth's copies of the shared embedding and head."""
        depth = cfg.mtp.depth if cfg.mtp is not None else 0

        def unread(name: str) -> bool:
            parts = name.removeprefix("model.").split(".")
            if len(parts) < 3 or parts[0] != "layers" or not parts[1].isdigit() or int(parts[1]) < cfg.num_layers:
                return False
            return int(parts[1]) >= cfg.num_layers + depth or ".".join(parts[2:]) in _SHARED_COPIES
        return frozenset(n for n in hf_names if unread(n))

    def _attn_rules(self, cfg: ModelConfig, t: str, h: str) -> list[tuple[Rule, _Permute | None]]:
        """(rename rule, RoPE row permutation to HF or None) for one layer's attention."""
        m = cfg.mla
        assert m is not None
        d, heads, qk, rope = cfg.hidden_size, cfg.num_heads, m.qk_head_dim, m.qk_rope_head_dim
        perm = m.rope_interleave
        out: list[tuple[Rule, _Permute | None]] = []
        q_perm = _Permute(qk, m.qk_nope_head_dim, rope, True) if perm else None
        if m.q_lora_rank is None:
            out.append((Rule(h + "self_attn.q_proj.weight", (t + "attn.q_proj.weight",), (heads * qk, d)), q_perm))
        else:
            r = m.q_lora_rank
            out += [(Rule(h + "self_attn.q_a_proj.weight", (t + "attn.q_a_proj.weight",), (r, d)), None),
                    (Rule(h + "self_attn.q_a_layernorm.weight", (t + "attn.q_a_norm.weight",), (r,)), None),
                    (Rule(h + "self_attn.q_b_proj.weight", (t + "attn.q_b_proj.weight",), (heads * qk, r)), q_perm)]
        kv_a = (m.kv_lora_rank + rope, d)
        kv_perm = _Permute(kv_a[0], m.kv_lora_rank, rope, True) if perm else None
        out += [(Rule(h + "self_attn.kv_a_proj_with_mqa.weight", (t + "attn.kv_a_proj.weight",), kv_a), kv_perm),
                (Rule(h + "self_attn.kv_a_layernorm.weight", (t + "attn.kv_a_norm.weight",), (m.kv_lora_rank,)), None),
                (Rule(h + "self_attn.kv_b_proj.weight", (t + "attn.kv_b_proj.weight",),
                      (heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank)), None),
                (Rule(h + "self_attn.o_proj.weight", (t + "attn.o_proj.weight",), (d, heads * m.v_head_dim)), None)]
        return out

    def _moe_extra(self, cfg: ModelConfig, i: int, t: str, h: str) -> list[Rule]:
        moe = cfg.moe
        if moe is None or not cfg.is_moe_layer(i):
            return []
        d, f = cfg.hidden_size, moe.shared_size
        rules = [Rule(h + "mlp.gate.e_score_correction_bias", (t + "mlp.expert_bias",), (moe.num_experts,))]
        for proj, shape in (("gate_proj", (f, d)), ("up_proj", (f, d)), ("down_proj", (d, f))):
            rules.append(Rule(h + f"mlp.shared_experts.{proj}.weight", (t + f"mlp.shared.{proj}.weight",), shape))
        return rules

    def _block_rules(self, cfg: ModelConfig, i: int, t: str, h: str) -> list[Rule]:
        d = cfg.hidden_size
        rules = [Rule(h + "input_layernorm.weight", (t + "attn_norm.weight",), (d,))]
        rules += [r if p is None else Rule(r.target, r.sources, r.shape, p) for r, p in self._attn_rules(cfg, t, h)]
        rules.append(Rule(h + "post_attention_layernorm.weight", (t + "mlp_norm.weight",), (d,)))
        return rules + self.mlp_rules(cfg, i, t, h) + self._moe_extra(cfg, i, t, h)

    def _mtp_rules(self, cfg: ModelConfig) -> list[Rule]:
        """Each MTP depth as DeepSeek stores it: layer num_layers + k (its copies of the shared
        embedding and head included)."""
        d, v = cfg.hidden_size, cfg.vocab_size
        rules: list[Rule] = []
        for k in range(cfg.mtp.depth if cfg.mtp is not None else 0):
            i = cfg.num_layers + k
            t, h = f"mtp.layers.{k}.", f"model.layers.{i}."
            rules += [Rule(h + "embed_tokens.weight", ("embed_tokens.weight",), (v, d)),
                      Rule(h + "enorm.weight", (t + "enorm.weight",), (d,)),
                      Rule(h + "hnorm.weight", (t + "hnorm.weight",), (d,)),
                      Rule(h + "eh_proj.weight", (t + "eh_proj.weight",), (d, 2 * d))]
            rules += self._block_rules(cfg, i, t, h)
            rules += [Rule(h + "shared_head.norm.weight", (t + "head_norm.weight",), (d,)),
                      Rule(h + "shared_head.head.weight", ("lm_head.weight",), (v, d))]
        return rules

    def export_rules(self, cfg: ModelConfig) -> list[Rule]:
        d, v = cfg.hidden_size, cfg.vocab_size
        rules = [Rule("model.embed_tokens.weight", ("embed_tokens.weight",), (v, d))]
        for i in range(cfg.num_layers):
            rules += self._block_rules(cfg, i, f"layers.{i}.", f"model.layers.{i}.")
        rules.append(Rule("model.norm.weight", ("final_norm.weight",), (d,)))
        rules.append(Rule(HEAD, ("lm_head.weight",), (v, d)))
        return rules + self._mtp_rules(cfg)

    def import_rules(self, cfg: ModelConfig, hf_names: set[str]) -> list[Rule]:
        m = cfg.mla
        assert m is not None
        rules: list[Rule] = []
        experts: dict[str, list[Rule]] = {}
        permuted: dict[str, _Permute] = {}
        prefixes = [(f"layers.{i}.", f"model.layers.{i}.") for i in range(cfg.num_layers)]
        prefixes += [(f"mtp.layers.{k}.", f"model.layers.{cfg.num_layers + k}.")
                     for k in range(cfg.mtp.depth if cfg.mtp is not None else 0)]
        for t, h in prefixes:
            for r, p in self._attn_rules(cfg, t, h):
                if p is not None:
                    permuted[r.target] = _Permute(p.width, p.start, p.rope, to_hf=False)
        for r in self.export_rules(cfg):
            if r.target.split(".", 3)[-1] in _SHARED_COPIES and r.target.startswith("model.layers."):
                continue  # an MTP depth's copy of the shared embedding or head (unread_names)
            if r.target in permuted:
                rules.append(Rule(r.sources[0], (r.target,), r.shape, permuted[r.target]))
            elif r.combine is None:
                rules.extend(inverse([r]))
            else:  # one expert of a stacked tensor
                experts.setdefault(r.sources[0], []).append(r)
        for target, parts in experts.items():
            rules.append(Rule(target, tuple(p.target for p in parts), parts[0].source_shapes[0], _stack,
                              tuple(p.shape for p in parts)))
        if prefix_of(hf_names, "model."):
            return rules
        return [Rule(r.target, tuple(s.removeprefix("model.") for s in r.sources), r.shape, r.combine,
                     r.source_shapes) for r in rules]
