"""Megatron-Core's GPTModel with multi-latent attention and MoE (DeepSeek-V3-class) <-> Tessera's
causal LM with `mla` (and `moe`): tensor names and layouts of its `torch_dist` checkpoints, both
directions (used by `export --format megatron` and `import --format megatron`).

Names are those of Megatron's Transformer Engine layer spec for MLA with qk_layernorm (what
DeepSeek-V3 runs train with): the q/kv latent norms fused into the up projections, the dense MLP's
norm into linear_fc1. Where dense and MoE layers mix (DeepSeek's list `--moe-layer-freq`) Megatron
saves one entry per global layer number (`decoder.layers.<i>.`); where all layers are alike it
stacks them along a leading axis (`decoder.layers.<rest>` [L, ...]): export does as Megatron,
import reads either. Per layer:

    input_layernorm.weight                              layers.i.attn_norm.weight
    self_attention.linear_q_proj.weight                 attn.q_proj.weight        (no q_lora_rank)
    self_attention.linear_q_down_proj.weight            attn.q_a_proj.weight
    self_attention.linear_q_up_proj.layer_norm_weight   attn.q_a_norm.weight
    self_attention.linear_q_up_proj.weight              attn.q_b_proj.weight
    self_attention.linear_kv_down_proj.weight           attn.kv_a_proj.weight     ([latent | rope key])
    self_attention.linear_kv_up_proj.layer_norm_weight  attn.kv_a_norm.weight
    self_attention.linear_kv_up_proj.weight             attn.kv_b_proj.weight     (per head [k_nope | v])
    self_attention.linear_proj.weight                   attn.o_proj.weight
  dense layers:
    mlp.linear_fc1.layer_norm_weight                    mlp_norm.weight
    mlp.linear_fc1.weight / linear_fc2.weight           [gate; up] / down_proj
  MoE layers:
    pre_mlp_layernorm.weight                            mlp_norm.weight
    mlp.router.weight, mlp.router.expert_bias           mlp.router.weight, mlp.expert_bias
    mlp.experts.experts.linear_fc1.weight [E, 2f, d]    experts [gate; up] per expert
    mlp.experts.experts.linear_fc2.weight [E, d, f]     experts.down_proj
    mlp.shared_experts.linear_fc{1,2}.weight            shared [gate; up], shared.down_proj
    embedding.word_embeddings.weight, decoder.final_layernorm.weight, output_layer.weight
  multi-token prediction depth k (Megatron's MultiTokenPredictionLayer; GPTModel's mtp_num_layers):
    mtp.layers.<k>.enorm.weight / hnorm.weight          mtp.layers.k.enorm / hnorm
    mtp.layers.<k>.eh_proj.weight [d, 2d]               mtp.layers.k.eh_proj   (column-parallel there)
    mtp.layers.<k>.transformer_layer.<a layer's names>  mtp.layers.k.<block>   (one entry per depth)
    mtp.layers.<k>.final_layernorm.weight               mtp.layers.k.head_norm
  (no copy of the shared embedding or output layer: Megatron's MTP layers use GPTModel's.)

Megatron's MLA always applies RoPE to DeepSeek's interleaved pairs (its rope_utils de-interleaves
them first), so the RoPE rows of each query head and of the shared key are stored interleaved, as
DeepSeek's and transformers' checkpoints do; Tessera stores rotate-half, so both directions permute
those rows (the Hugging Face adapter's permutation). Megatron's local spec names the norms
`self_attention.{q,kv}_layernorm` and a dense layer's `pre_mlp_layernorm`: import reads those too.
"""

from __future__ import annotations

import torch

from tessera.common.errors import UserError
from tessera.common.hf.rules import Rule, rows
from tessera.common.models.causal_lm.config import ModelConfig
from tessera.common.models.causal_lm.hf.deepseek_v3 import _Permute

# Megatron's Transformer Engine names (which this module writes) -> its local layer spec's (read too).
LOCAL_NAMES = {"self_attention.linear_q_up_proj.layer_norm_weight": "self_attention.q_layernorm.weight",
               "self_attention.linear_kv_up_proj.layer_norm_weight": "self_attention.kv_layernorm.weight",
               "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight"}


def check_megatron(cfg: ModelConfig, where: str = "model config") -> None:
    """Refuse what Megatron's MLA GPTModel cannot hold, naming the field."""
    assert cfg.mla is not None
    wrong = {k: v for k, v in (("bias", cfg.bias), ("qk_norm", cfg.qk_norm), ("sliding_window", cfg.sliding_window),
                                ("activation", cfg.activation if cfg.activation != "swiglu" else None),
                                ("norm", cfg.norm if cfg.norm != "rmsnorm" else None)) if v}
    if wrong:
        raise UserError(f"{where}: {wrong} has no Megatron-Core MLA equivalent here (bias-free SwiGLU layers, "
                        "RMSNorm)")
    last = cfg.is_moe_layer(cfg.num_layers - 1)
    for k in range(cfg.mtp.depth if cfg.mtp is not None else 0):
        if cfg.is_moe_layer(cfg.num_layers + k) != last:  # Megatron builds every MTP layer as the last layer
            kinds = ("dense", "MoE")
            raise UserError(f"{where}: model.mtp depth {k + 1}'s block is {kinds[not last]} (layer "
                            f"{cfg.num_layers + k}) but Megatron-Core builds MTP layers like the last decoder "
                            f"layer ({kinds[last]}); choose moe.first_k_dense / moe.layer_freq that agree")


def stacked(cfg: ModelConfig) -> bool:
    """Whether Megatron (by default) saves the layers stacked along a leading axis: when they are all
    alike (no MoE, or MoE in every layer); dense and MoE layers mixed are saved one entry per layer."""
    return cfg.moe is None or (cfg.moe.first_k_dense == 0 and cfg.moe.layer_freq == 1)


def _cat(ts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(ts, dim=-2)


def _half(part: int, f: int):
    """Combine: gate (0) or up (1) rows of a fused [gate; up] (dim -2: experts' [E, 2f, d] too)."""
    return lambda ts: ts[0].narrow(-2, part * f, f)


def export_rules(cfg: ModelConfig, vocab_rows: int) -> list[Rule]:
    """Megatron tensor <- Tessera tensors, one rule per Megatron tensor (layers stacked or not, as
    Megatron saves this model)."""
    rules = _per_layer_export_rules(cfg, vocab_rows)
    return stack_export(rules) if stacked(cfg) else rules


def _per_layer_export_rules(cfg: ModelConfig, vocab_rows: int) -> list[Rule]:
    d, v = cfg.hidden_size, cfg.vocab_size

    def pad(ts: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat([ts[0][:v], ts[0].new_zeros(vocab_rows - v, d)])

    out = [Rule("embedding.word_embeddings.weight", ("embed_tokens.weight",), (vocab_rows, d), pad,
                ((cfg.vocab_rows, d),))]
    for i in range(cfg.num_layers):
        out += _block_rules(cfg, i, f"layers.{i}.", f"decoder.layers.{i}.")
    out.append(Rule("decoder.final_layernorm.weight", ("final_norm.weight",), (d,)))
    if not cfg.tie_embeddings:
        out.append(Rule("output_layer.weight", ("lm_head.weight",), (vocab_rows, d), pad, ((cfg.vocab_rows, d),)))
    # Multi-token prediction: Megatron's MultiTokenPredictionLayer k holds no copy of the embedding or
    # output layer (GPTModel hands it its own; under pipeline parallel the last stage's copy is saved
    # under the same key as a replica), and its block's names are a decoder layer's, never stacked.
    for k in range(cfg.mtp.depth if cfg.mtp is not None else 0):
        t, g = f"mtp.layers.{k}.", f"mtp.layers.{k}."
        out += [Rule(g + "enorm.weight", (t + "enorm.weight",), (d,)),
                Rule(g + "hnorm.weight", (t + "hnorm.weight",), (d,)),
                # [embedding | hidden] columns in both (Megatron concatenates the normed embedding first)
                Rule(g + "eh_proj.weight", (t + "eh_proj.weight",), (d, 2 * d))]
        out += _block_rules(cfg, cfg.num_layers + k, t, g + "transformer_layer.")
        out.append(Rule(g + "final_layernorm.weight", (t + "head_norm.weight",), (d,)))
    return out


def _block_rules(cfg: ModelConfig, i: int, t: str, g: str) -> list[Rule]:
    """One transformer layer (global number `i`: dense or MoE) under Tessera prefix `t` and Megatron
    prefix `g` (`decoder.layers.<i>.` or an MTP layer's `mtp.layers.<k>.transformer_layer.`)."""
    m, moe = cfg.mla, cfg.moe
    assert m is not None
    d, h, rope = cfg.hidden_size, cfg.num_heads, m.qk_rope_head_dim
    out: list[Rule] = []

    def rename(theirs: str, ours: str, shape: tuple[int, ...], combine=None) -> None:
        out.append(Rule(theirs, (ours,), shape, combine))

    q_perm = _Permute(m.qk_head_dim, m.qk_nope_head_dim, rope, True)
    kv_perm = _Permute(m.kv_lora_rank + rope, m.kv_lora_rank, rope, True)
    a, s = t + "attn.", g + "self_attention."
    rename(g + "input_layernorm.weight", t + "attn_norm.weight", (d,))
    if m.q_lora_rank is None:
        rename(s + "linear_q_proj.weight", a + "q_proj.weight", (h * m.qk_head_dim, d), q_perm)
    else:
        r = m.q_lora_rank
        rename(s + "linear_q_down_proj.weight", a + "q_a_proj.weight", (r, d))
        rename(s + "linear_q_up_proj.layer_norm_weight", a + "q_a_norm.weight", (r,))
        rename(s + "linear_q_up_proj.weight", a + "q_b_proj.weight", (h * m.qk_head_dim, r), q_perm)
    rename(s + "linear_kv_down_proj.weight", a + "kv_a_proj.weight", (m.kv_lora_rank + rope, d), kv_perm)
    rename(s + "linear_kv_up_proj.layer_norm_weight", a + "kv_a_norm.weight", (m.kv_lora_rank,))
    rename(s + "linear_kv_up_proj.weight", a + "kv_b_proj.weight",
           (h * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank))
    rename(s + "linear_proj.weight", a + "o_proj.weight", (d, h * m.v_head_dim))
    x = t + "mlp."
    if moe is not None and cfg.is_moe_layer(i):
        e, f, sh = moe.num_experts, moe.ffn_hidden_size, moe.shared_size
        rename(g + "pre_mlp_layernorm.weight", t + "mlp_norm.weight", (d,))
        rename(g + "mlp.router.weight", x + "router.weight", (e, d))
        rename(g + "mlp.router.expert_bias", x + "expert_bias", (e,))
        out.append(Rule(g + "mlp.experts.experts.linear_fc1.weight", (x + "experts.gate_proj", x + "experts.up_proj"),
                        (e, 2 * f, d), _cat, ((e, f, d), (e, f, d))))
        rename(g + "mlp.experts.experts.linear_fc2.weight", x + "experts.down_proj", (e, d, f))
        if sh:
            out.append(Rule(g + "mlp.shared_experts.linear_fc1.weight", (x + "shared.gate_proj.weight",
                            x + "shared.up_proj.weight"), (2 * sh, d), _cat, ((sh, d), (sh, d))))
            rename(g + "mlp.shared_experts.linear_fc2.weight", x + "shared.down_proj.weight", (d, sh))
    else:
        f = cfg.ffn_hidden_size
        rename(g + "mlp.linear_fc1.layer_norm_weight", t + "mlp_norm.weight", (d,))
        out.append(Rule(g + "mlp.linear_fc1.weight", (x + "gate_proj.weight", x + "up_proj.weight"), (2 * f, d),
                        _cat, ((f, d), (f, d))))
        rename(g + "mlp.linear_fc2.weight", x + "down_proj.weight", (d, f))
    return out


def _layer_of(name: str, prefix: str) -> tuple[int, str] | None:
    """`<prefix><i>.<rest>` -> (i, rest)."""
    if not name.startswith(prefix):
        return None
    i, _, rest = name[len(prefix):].partition(".")
    return (int(i), rest) if i.isdigit() and rest else None


def stack_export(rules: list[Rule], prefix: str = "decoder.layers.") -> list[Rule]:
    """Per-layer rules -> one rule per `<prefix><rest>` tensor of shape [L, ...], in place of the
    layers' rules (GPTModel's `decoder.layers.`, BertModel's `encoder.layers.`)."""
    per: dict[str, list[Rule]] = {}
    out: list[Rule | str] = []
    for r in rules:
        at = _layer_of(r.target, prefix)
        if at is None:
            out.append(r)
            continue
        if at[1] not in per:
            out.append(at[1])
        per.setdefault(at[1], []).append(r)

    def stack(rest: str) -> Rule:
        layer_rules = per[rest]
        counts = [len(r.sources) for r in layer_rules]
        starts = [sum(counts[:k]) for k in range(len(counts))]

        def combine(ts: list[torch.Tensor]) -> torch.Tensor:
            return torch.stack([r.apply(ts[s:s + n]) for r, s, n in zip(layer_rules, starts, counts)])
        return Rule(prefix + rest, tuple(s for r in layer_rules for s in r.sources),
                    (len(layer_rules), *layer_rules[0].shape), combine,
                    tuple(x for r in layer_rules for x in r.input_shapes()))
    return [stack(r) if isinstance(r, str) else r for r in out]


def stack_import(rules: list[Rule], num_layers: int, prefix: str = "decoder.layers.") -> list[Rule]:
    """Per-layer import rules reading `<prefix><i>.<rest>` -> reading row i of the stacked
    `<prefix><rest>`."""
    out = []
    for r in rules:
        at = _layer_of(r.sources[0], prefix)
        if at is None:
            out.append(r)
            continue
        i, rest = at

        def take(ts: list[torch.Tensor], r=r, i=i) -> torch.Tensor:
            return r.apply([ts[0][i]])
        out.append(Rule(r.target, (prefix + rest,), r.shape, take, ((num_layers, *r.input_shapes()[0]),)))
    return out


def import_rules(cfg: ModelConfig, vocab_rows: int, stacked_layers: bool) -> list[Rule]:
    """Tessera tensor <- Megatron tensor: the inverse of export_rules (padding rows dropped), from a
    checkpoint whose layers are stacked or one entry each (Megatron writes either for alike layers)."""
    out = []
    for r in _per_layer_export_rules(cfg, vocab_rows):
        if len(r.sources) == 2:  # a fused [gate; up]
            half = r.input_shapes()[0][-2]
            out += [Rule(s, (r.target,), shape, _half(part, half), (r.shape,))
                    for part, (s, shape) in enumerate(zip(r.sources, r.input_shapes()))]
        elif isinstance(r.combine, _Permute):
            p = r.combine
            out.append(Rule(r.sources[0], (r.target,), r.shape, _Permute(p.width, p.start, p.rope, to_hf=False)))
        elif r.combine is not None:  # the vocabulary's padded rows
            out.append(Rule(r.sources[0], (r.target,), r.input_shapes()[0], rows(0, cfg.vocab_size, False), (r.shape,)))
        else:
            out.append(Rule(r.sources[0], (r.target,), r.shape))
    return stack_import(out, cfg.num_layers) if stacked_layers else out


def extra_state_keys(cfg: ModelConfig) -> list[str]:
    """The `_extra_state` entries Megatron writes for its linear layers ([None] each for local,
    non-FP8 layers; stacked layers number them shard_<layer>_<L>, stacked experts
    shard_<layer>.<expert>_<L>.<E>; per-layer entries and MTP layers shard_0_1 and shard_<expert>_<E>);
    its loader expects them."""
    m, L = cfg.mla, cfg.num_layers
    assert m is not None
    together = stacked(cfg)
    keys = []
    for i in range(L):
        g, one = ("decoder.layers.", f"shard_{i}_{L}") if together else (f"decoder.layers.{i}.", "shard_0_1")
        keys += _layer_extra_state(cfg, i, g, one, f"shard_{i}.{{j}}_{L}.{{e}}" if together else "shard_{j}_{e}")
    for k in range(cfg.mtp.depth if cfg.mtp is not None else 0):
        g = f"mtp.layers.{k}."
        keys.append(g + "eh_proj._extra_state/shard_0_1")
        keys += _layer_extra_state(cfg, L + k, g + "transformer_layer.", "shard_0_1", "shard_{j}_{e}")
    return keys


def _layer_extra_state(cfg: ModelConfig, i: int, g: str, one: str, expert: str) -> list[str]:
    """One layer's `_extra_state` keys under prefix `g`: `one` names a linear layer's shard, `expert`
    (a format string of j, e) an expert's."""
    m, moe = cfg.mla, cfg.moe
    assert m is not None
    names = ["self_attention.linear_proj", "self_attention.linear_kv_down_proj", "self_attention.linear_kv_up_proj"]
    names += (["self_attention.linear_q_proj"] if m.q_lora_rank is None
              else ["self_attention.linear_q_down_proj", "self_attention.linear_q_up_proj"])
    keys = []
    if moe is not None and cfg.is_moe_layer(i):
        e = moe.num_experts
        keys += [f"{g}mlp.experts.experts.{fc}._extra_state/" + expert.format(j=j, e=e)
                 for j in range(e) for fc in ("linear_fc1", "linear_fc2")]
        if moe.shared_size:
            names += ["mlp.shared_experts.linear_fc1", "mlp.shared_experts.linear_fc2"]
    else:
        names += ["mlp.linear_fc1", "mlp.linear_fc2"]
    return keys + [f"{g}{name}._extra_state/{one}" for name in names]
