"""GPT-2 (transformers' `GPT2LMHeadModel`) <-> Tessera.

Facts (transformers' modelling code is the reference; the parity tests compare logits and greedy
generations with transformers): Conv1D layers store weights transposed ([in, out]); attention is
one fused `c_attn` = [q; k; v] along the output dimension; the MLP is c_fc (up) and c_proj
(down); every linear layer has a bias. The head is tied unless `tie_word_embeddings` is false
(transformers' default for GPT-2 is tied); an untied head is `lm_head.weight`, outside the
`transformer.` prefix.
"""

from __future__ import annotations

from typing import Any

from tessera.common.errors import UserError
from tessera.common.hf.architecture import HEAD, HFArchitecture, HFConfig, prefix_of
from tessera.common.hf.rules import Combine, Rule, cat, cat_rows_t, rows, transpose, zeros
from tessera.common.models.causal_lm.config import ModelConfig

_TANH_GELU = ("gelu_new", "gelu_pytorch_tanh")  # what Tessera's gelu computes (tanh approximation)


class GPT2(HFArchitecture):
    model_type, hf_class, arch = "gpt2", "GPT2LMHeadModel", "gpt2"

    def config_fields(self, c: HFConfig) -> dict[str, Any]:
        c.require("activation_function", c.text("activation_function", "gelu_new"), _TANH_GELU,
                  "Tessera's GPT-2 MLP uses the tanh GELU, gelu_new")
        for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn", "add_cross_attention"):
            c.require(flag, c.flag(flag, False), (False,), "Tessera's GPT-2 attention has no such option")
        c.require("scale_attn_weights", c.flag("scale_attn_weights", True), (True,),
                  "Tessera scales attention by 1/sqrt(head_dim)")
        d = c.integer("n_embd")
        return dict(
            vocab_size=c.integer("vocab_size"), hidden_size=d, num_layers=c.integer("n_layer"),
            num_heads=c.integer("n_head"), ffn_hidden_size=c.integer("n_inner", 4 * d),
            max_seq_len=c.integer("n_positions"), norm="layernorm", norm_eps=c.number("layer_norm_epsilon", 1e-5, positive=True),
            activation="gelu", position="learned", bias=True, tie_embeddings=c.flag("tie_word_embeddings", True),
            dropout=c.number("resid_pdrop", 0.0), attention_dropout=c.number("attn_pdrop", 0.0),
            init_std=c.number("initializer_range", 0.02, positive=True))

    def hf_fields(self, cfg: ModelConfig) -> dict[str, Any]:
        return {
            "n_positions": cfg.max_seq_len,
            "n_ctx": cfg.max_seq_len,
            "n_embd": cfg.hidden_size,
            "n_layer": cfg.num_layers,
            "n_head": cfg.num_heads,
            "n_inner": cfg.ffn_hidden_size,
            "activation_function": "gelu_new",
            "layer_norm_epsilon": cfg.norm_eps,
            "resid_pdrop": cfg.dropout,
            "embd_pdrop": cfg.dropout,
            "attn_pdrop": cfg.attention_dropout,
            "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False,
            "reorder_and_upcast_attn": False,
        }

    def check_exportable(self, cfg: ModelConfig) -> None:
        why = "needs layernorm, gelu, learned positions, num_kv_heads=num_heads"
        self._refuse_fields(cfg, {"norm": "layernorm", "activation": "gelu", "position": "learned"}, why)
        if cfg.kv_heads != cfg.num_heads:
            raise UserError(f"model config: arch=gpt2 with grouped-query attention has no {self.hf_class} "
                            f"equivalent ({why})")

    def export_rules(self, cfg: ModelConfig) -> list[Rule]:
        d, f, v = cfg.hidden_size, cfg.ffn_hidden_size, cfg.vocab_size
        rules = [Rule("transformer.wte.weight", ("embed_tokens.weight",), (v, d)),
                 Rule("transformer.wpe.weight", ("pos_embed.weight",), (cfg.max_seq_len, d))]

        def bias(target: str, sources: tuple[str, ...], shape: tuple[int, ...], combine: Combine | None = None) -> Rule:
            # HF GPT-2 always has biases; a bias-free Tessera model exports exact zeros.
            if cfg.bias:
                return Rule(target, sources, shape, combine)
            return Rule(target, (), shape, zeros(shape))

        for i in range(cfg.num_layers):
            t, h = f"layers.{i}.", f"transformer.h.{i}."
            for ours, theirs in (("attn_norm", "ln_1"), ("mlp_norm", "ln_2")):
                rules.append(Rule(h + f"{theirs}.weight", (t + f"{ours}.weight",), (d,)))
                rules.append(Rule(h + f"{theirs}.bias", (t + f"{ours}.bias",), (d,)))
            qkv = tuple(t + f"attn.{p}_proj" for p in "qkv")
            rules.append(Rule(h + "attn.c_attn.weight", tuple(s + ".weight" for s in qkv), (d, 3 * d), cat_rows_t))
            rules.append(bias(h + "attn.c_attn.bias", tuple(s + ".bias" for s in qkv), (3 * d,), cat))
            rules.append(Rule(h + "attn.c_proj.weight", (t + "attn.o_proj.weight",), (d, d), transpose))
            rules.append(bias(h + "attn.c_proj.bias", (t + "attn.o_proj.bias",), (d,)))
            rules.append(Rule(h + "mlp.c_fc.weight", (t + "mlp.up_proj.weight",), (d, f), transpose))
            rules.append(bias(h + "mlp.c_fc.bias", (t + "mlp.up_proj.bias",), (f,)))
            rules.append(Rule(h + "mlp.c_proj.weight", (t + "mlp.down_proj.weight",), (f, d), transpose))
            rules.append(bias(h + "mlp.c_proj.bias", (t + "mlp.down_proj.bias",), (d,)))
        rules.append(Rule("transformer.ln_f.weight", ("final_norm.weight",), (d,)))
        rules.append(Rule("transformer.ln_f.bias", ("final_norm.bias",), (d,)))
        if not cfg.tie_embeddings:
            rules.append(Rule(HEAD, ("lm_head.weight",), (v, d)))
        return rules

    def import_rules(self, cfg: ModelConfig, hf_names: set[str]) -> list[Rule]:
        prefix = prefix_of(hf_names, "transformer.")
        d, f, v = cfg.hidden_size, cfg.ffn_hidden_size, cfg.vocab_size
        rules = [Rule("embed_tokens.weight", (prefix + "wte.weight",), (v, d)),
                 Rule("pos_embed.weight", (prefix + "wpe.weight",), (cfg.max_seq_len, d))]
        for i in range(cfg.num_layers):
            t, h = f"layers.{i}.", f"{prefix}h.{i}."
            for ours, theirs in (("attn_norm", "ln_1"), ("mlp_norm", "ln_2")):
                rules.append(Rule(t + f"{ours}.weight", (h + f"{theirs}.weight",), (d,)))
                rules.append(Rule(t + f"{ours}.bias", (h + f"{theirs}.bias",), (d,)))
            for j, p in enumerate("qkv"):
                rules.append(Rule(t + f"attn.{p}_proj.weight", (h + "attn.c_attn.weight",), (d, d),
                                  rows(j * d, (j + 1) * d, transposed=True), ((d, 3 * d),)))
                rules.append(Rule(t + f"attn.{p}_proj.bias", (h + "attn.c_attn.bias",), (d,),
                                  rows(j * d, (j + 1) * d, transposed=False), ((3 * d,),)))
            for ours, theirs, (n_in, n_out) in (("attn.o_proj", "attn.c_proj", (d, d)), ("mlp.up_proj", "mlp.c_fc", (d, f)),
                                                 ("mlp.down_proj", "mlp.c_proj", (f, d))):
                rules.append(Rule(t + f"{ours}.weight", (h + f"{theirs}.weight",), (n_out, n_in), transpose, ((n_in, n_out),)))
                rules.append(Rule(t + f"{ours}.bias", (h + f"{theirs}.bias",), (n_out,)))
        rules.append(Rule("final_norm.weight", (prefix + "ln_f.weight",), (d,)))
        rules.append(Rule("final_norm.bias", (prefix + "ln_f.bias",), (d,)))
        if not cfg.tie_embeddings:
            rules.append(Rule("lm_head.weight", (HEAD,), (v, d)))
        return rules
