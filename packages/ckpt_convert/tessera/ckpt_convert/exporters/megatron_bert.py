"""Megatron-Core's `BertModel` <-> Tessera's pre-LayerNorm encoder (`norm_placement: pre`): tensor
names and layouts of its `torch_dist` checkpoints, both directions (used by `export --format
megatron` and `import --format megatron`).

BertModel's blocks are pre-LayerNorm (its layer specs have no post-norm option): a norm before
attention and before the MLP, a final norm after the last layer, no embedding norm; the MLM head
is dense + erf GELU + LayerNorm, then `output_layer` (tied to the word embedding unless
`share_embeddings_and_output_weights` is off) with its own bias; the pooler exists exactly when the
binary head does (`add_binary_head`). Its TransformerBlock saves the layers stacked along a
leading axis (`encoder.layers.<rest>` [L, ...]); the local spec's norms are saved under the
Transformer Engine spec's names (its sharded_state_dict_keys_map), so both specs' checkpoints hold:

    embedding.word_embeddings.weight        embed_tokens.weight          (rows: Megatron's padded vocab)
    embedding.position_embeddings.weight    pos_embed.weight
    embedding.tokentype_embeddings.weight   token_type_embed.weight      (absent with no token types)
    encoder.layers.self_attention.linear_qkv.layer_norm_{weight,bias}   layers.i.attn_norm
    encoder.layers.self_attention.linear_qkv.{weight,bias}   q/k/v_proj, rows per head [q_h | k_h | v_h]
    encoder.layers.self_attention.linear_proj.{weight,bias}  attn.o_proj
    encoder.layers.mlp.linear_fc1.layer_norm_{weight,bias}   layers.i.mlp_norm
    encoder.layers.mlp.linear_fc1 / linear_fc2.{weight,bias} mlp.up_proj / mlp.down_proj
    encoder.final_layernorm.{weight,bias}   final_norm
    lm_head.dense.{weight,bias}, lm_head.layer_norm.{weight,bias}   mlm_head.dense, mlm_head.norm
    output_layer.weight                     mlm_head.decoder.weight      (untied only; padded rows)
    output_layer.bias                       mlm_head.decoder.bias        (padded rows)
    pooler.dense.{weight,bias}, binary_head.{weight,bias}   the same names (with the binary head)

Padding rows are zero on export and dropped on import (Tessera's own padding rows, if its config
has any, are zero too).
"""

from __future__ import annotations

import torch

from tessera.ckpt_convert.exporters.megatron_hybrid import EXTRA_STATE_MODULES, fuse_qkv, split_qkv
from tessera.ckpt_convert.exporters.megatron_mla import stack_export, stack_import
from tessera.common.errors import UserError
from tessera.common.hf.rules import Rule
from tessera.common.models.encoder.config import EncoderConfig

LAYERS = "encoder.layers."
POST_LN = ("norm_placement=post (BERT's post-LayerNorm blocks) has no Megatron-Core equivalent: its BertModel is "
           "pre-LayerNorm (norms before attention and MLP, a final norm, no embedding norm; its TransformerLayer has "
           "no post-norm option); use --format hf, or a pre-LayerNorm encoder (norm_placement: pre)")


def check_megatron(cfg: EncoderConfig, where: str = "model config") -> None:
    """Refuse what Megatron-Core's BertModel cannot hold, in one line naming the field."""
    if cfg.norm_placement != "pre":
        raise UserError(f"{where}: {POST_LN}")
    if not cfg.mlm_head:
        raise UserError(f"{where}: mlm_head=false has no Megatron-Core equivalent (its BertModel always has the "
                        "masked-LM head: lm_head and output_layer); use --format hf")
    if cfg.pooler != cfg.binary_head:
        raise UserError(f"{where}: pooler={cfg.pooler} with binary_head={cfg.binary_head} has no Megatron-Core "
                        "equivalent (its BertModel has a pooler exactly when it has the binary head); set both alike")
    if cfg.activation != "gelu_erf":
        raise UserError(f"{where}: activation={cfg.activation!r} has no Megatron-Core equivalent (its BertLMHead "
                        "applies the erf GELU); use --format hf")


def _vocab(v: int, rows: int):
    """Combine: the first `v` (real) rows of a vocabulary tensor, then zero rows up to `rows` (both
    directions: Megatron's padding on export, Tessera's own on import)."""
    def repad(ts: list[torch.Tensor]) -> torch.Tensor:
        real = ts[0][:v]
        return torch.cat([real, real.new_zeros(rows - v, *real.shape[1:])]) if rows > v else real
    return repad


def _per_layer_export_rules(cfg: EncoderConfig, vocab_rows: int) -> list[Rule]:
    """Megatron tensor <- Tessera tensors, layers one entry each (`encoder.layers.<i>.`)."""
    d, f, h, hd, v, ours = cfg.hidden_size, cfg.ffn_hidden_size, cfg.num_heads, cfg.head_dim, cfg.vocab_size, cfg.vocab_rows
    out: list[Rule] = []

    def pair(theirs: str, mine: str, weight: tuple[int, ...]) -> None:  # theirs/mine + "weight" and + "bias"
        out.append(Rule(theirs + "weight", (mine + "weight",), weight))
        out.append(Rule(theirs + "bias", (mine + "bias",), weight[:1]))

    def vocab(theirs: str, mine: str, width: tuple[int, ...]) -> None:
        out.append(Rule(theirs, (mine,), (vocab_rows, *width), _vocab(v, vocab_rows), ((ours, *width),)))

    vocab("embedding.word_embeddings.weight", "embed_tokens.weight", (d,))
    out.append(Rule("embedding.position_embeddings.weight", ("pos_embed.weight",), (cfg.max_seq_len, d)))
    if cfg.num_token_types:
        out.append(Rule("embedding.tokentype_embeddings.weight", ("token_type_embed.weight",), (cfg.num_token_types, d)))
    for i in range(cfg.num_layers):
        g, t = f"{LAYERS}{i}.", f"layers.{i}."
        qkv = fuse_qkv(h, 1, hd)  # multi-head attention: one query head per group
        pair(g + "self_attention.linear_qkv.layer_norm_", t + "attn_norm.", (d,))
        out += [Rule(g + "self_attention.linear_qkv.weight", tuple(t + f"attn.{p}_proj.weight" for p in "qkv"),
                     (3 * d, d), qkv, ((d, d),) * 3),
                Rule(g + "self_attention.linear_qkv.bias", tuple(t + f"attn.{p}_proj.bias" for p in "qkv"),
                     (3 * d,), qkv, ((d,),) * 3)]
        pair(g + "self_attention.linear_proj.", t + "attn.o_proj.", (d, d))
        pair(g + "mlp.linear_fc1.layer_norm_", t + "mlp_norm.", (d,))
        pair(g + "mlp.linear_fc1.", t + "mlp.up_proj.", (f, d))
        pair(g + "mlp.linear_fc2.", t + "mlp.down_proj.", (d, f))
    pair("encoder.final_layernorm.", "final_norm.", (d,))
    pair("lm_head.dense.", "mlm_head.dense.", (d, d))
    pair("lm_head.layer_norm.", "mlm_head.norm.", (d,))
    if not cfg.tie_embeddings:
        vocab("output_layer.weight", "mlm_head.decoder.weight", (d,))
    vocab("output_layer.bias", "mlm_head.decoder.bias", ())
    if cfg.binary_head:
        pair("pooler.dense.", "pooler.dense.", (d, d))
        pair("binary_head.", "binary_head.", (2, d))
    return out


def export_rules(cfg: EncoderConfig, vocab_rows: int) -> list[Rule]:
    """Megatron tensor <- Tessera tensors, one rule per Megatron tensor, layers stacked as
    BertModel saves them; `vocab_rows`: Megatron's padded vocabulary."""
    check_megatron(cfg)
    return stack_export(_per_layer_export_rules(cfg, vocab_rows), LAYERS)


def import_rules(cfg: EncoderConfig, vocab_rows: int) -> list[Rule]:
    """Tessera tensor <- Megatron tensor: the inverse of export_rules (Megatron's `vocab_rows`
    padding rows dropped)."""
    check_megatron(cfg, "--model-config")
    out = []
    for r in _per_layer_export_rules(cfg, vocab_rows):
        if len(r.sources) == 3:  # linear_qkv
            out += [Rule(s, (r.target,), shape, split_qkv(cfg.num_heads, 1, cfg.head_dim, part), (r.shape,))
                    for part, (s, shape) in enumerate(zip(r.sources, r.input_shapes()))]
        elif r.combine is not None:  # a vocabulary tensor
            mine = r.input_shapes()[0]
            out.append(Rule(r.sources[0], (r.target,), mine, _vocab(cfg.vocab_size, mine[0]), (r.shape,)))
        else:
            out.append(Rule(r.sources[0], (r.target,), r.shape))
    return stack_import(out, cfg.num_layers, LAYERS)


def extra_state_keys(cfg: EncoderConfig) -> list[str]:
    """The `_extra_state` entries BertModel's linear layers save (stacked layers numbered
    shard_<layer>_<L>; the output layer's, tied or not, shard_0_1); its loader expects them."""
    L = cfg.num_layers
    keys = [f"{LAYERS}{module}._extra_state/shard_{i}_{L}" for i in range(L) for module in EXTRA_STATE_MODULES]
    return keys + ["output_layer._extra_state/shard_0_1"]
