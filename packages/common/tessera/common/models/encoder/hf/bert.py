"""BERT (transformers' `BertModel`, `BertForMaskedLM`, `BertForPreTraining`) <-> Tessera's encoder.

Facts (transformers 5's modelling code is the reference; the parity tests compare hidden states,
logits and losses, and the exports' bytes, with transformers): every layer is a plain nn.Linear
with a bias (no fused q/k/v, no transposes); the heads a config.json has follow from its class:
BertModel has the pooler, BertForMaskedLM (its `bert.` body built without a pooler) the MLM head
`cls.predictions`, BertForPreTraining both and `cls.seq_relationship`. The MLM decoder's weight is
the word embedding unless `tie_word_embeddings` is false, and its bias is saved once, as
`cls.predictions.bias`; untied, transformers saves `cls.predictions.decoder.weight` and
`.decoder.bias` (the one its forward adds) beside an unused `cls.predictions.bias`, which export
writes equal to it. `hidden_act` "gelu" is the erf GELU.

`save_pretrained` writes config.json with sorted keys and the safetensors tensors sorted by name;
`hf_fields` gives the keys transformers writes for a BertConfig and the adapter orders the rules by
name, so an export is byte for byte what transformers itself would save.
"""

from __future__ import annotations

from typing import Any

from tessera.common.errors import UserError
from tessera.common.hf.architecture import HFArchitecture, HFConfig
from tessera.common.hf.rules import Rule
from tessera.common.models.encoder.config import EncoderConfig

# config.json `architectures` -> the heads (pooler, mlm_head, binary_head) of that class.
CLASSES: dict[str, tuple[bool, bool, bool]] = {
    "BertModel": (True, False, False),
    "BertForMaskedLM": (False, True, False),
    "BertForPreTraining": (True, True, True),
}
_ACTIVATIONS = {"gelu": "gelu_erf", "gelu_pytorch_tanh": "gelu"}  # HF hidden_act -> EncoderConfig.activation
# transformers' version whose save_pretrained this mapping reproduces byte for byte.
TRANSFORMERS_VERSION = "5.24.0"


def class_for(cfg: EncoderConfig) -> str | None:
    heads = (cfg.pooler, cfg.mlm_head, cfg.binary_head)
    return next((name for name, h in CLASSES.items() if h == heads), None)


class Bert(HFArchitecture):
    model_type, hf_class, arch = "bert", "BertForPreTraining", "bert"

    def config_fields(self, c: HFConfig) -> dict[str, Any]:
        archs = c.data.get("architectures")
        name = archs[0] if isinstance(archs, list) and archs else "BertModel"  # a bare save names no head
        if name not in CLASSES:
            c.fail("architectures", f"= {archs!r}: Tessera's encoder reads {', '.join(CLASSES)} (not {name})")
        act = c.text("hidden_act", "gelu")
        c.require("hidden_act", act, tuple(_ACTIVATIONS), "Tessera's encoder has the erf GELU and its tanh approximation")
        c.require("position_embedding_type", c.text("position_embedding_type", "absolute"), ("absolute",),
                  "Tessera's encoder has absolute position embeddings")
        for flag in ("is_decoder", "add_cross_attention"):
            c.require(flag, c.flag(flag, False), (False,), "Tessera's encoder is bidirectional, without cross-attention")
        pooler, mlm, binary = CLASSES[name]
        return dict(
            vocab_size=c.integer("vocab_size"), hidden_size=c.integer("hidden_size"),
            num_layers=c.integer("num_hidden_layers"), num_heads=c.integer("num_attention_heads"),
            ffn_hidden_size=c.integer("intermediate_size"), max_seq_len=c.integer("max_position_embeddings"),
            num_token_types=c.integer("type_vocab_size"), norm_eps=c.number("layer_norm_eps", 1e-12, positive=True),
            activation=_ACTIVATIONS[act], pooler=pooler, mlm_head=mlm, binary_head=binary,
            tie_embeddings=c.flag("tie_word_embeddings", True), dropout=c.number("hidden_dropout_prob", 0.1),
            attention_dropout=c.number("attention_probs_dropout_prob", 0.1),
            init_std=c.number("initializer_range", 0.02, positive=True))

    def hf_fields(self, cfg: EncoderConfig) -> dict[str, Any]:
        return {
            "add_cross_attention": False,
            "attention_probs_dropout_prob": cfg.attention_dropout,
            "classifier_dropout": None,
            "hidden_act": next(k for k, v in _ACTIVATIONS.items() if v == cfg.activation),
            "hidden_dropout_prob": cfg.dropout,
            "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.ffn_hidden_size,
            "is_decoder": False,
            "layer_norm_eps": cfg.norm_eps,
            "max_position_embeddings": cfg.max_seq_len,
            "num_attention_heads": cfg.num_heads,
            "num_hidden_layers": cfg.num_layers,
            "type_vocab_size": cfg.num_token_types,
        }

    def check_exportable(self, cfg: EncoderConfig) -> None:
        if class_for(cfg) is None:
            raise UserError(f"model config: encoder heads pooler={cfg.pooler}, mlm_head={cfg.mlm_head}, "
                            f"binary_head={cfg.binary_head} have no transformers class (BertModel: pooler only; "
                            "BertForMaskedLM: mlm_head only; BertForPreTraining: all three)")
        if cfg.num_token_types == 0:
            raise UserError("model config: num_token_types=0 has no transformers BERT equivalent (its token-type "
                            "table has at least one row)")

    def pairs(self, cfg: EncoderConfig) -> list[tuple[str, str, tuple[int, ...]]]:
        """(transformers name, Tessera name, shape) of every tensor transformers saves, in
        transformers' order; vocabulary tensors at vocab_size rows."""
        d, f, v = cfg.hidden_size, cfg.ffn_hidden_size, cfg.vocab_size
        body = "bert." if cfg.mlm_head else ""  # the *For* classes keep the body under `bert.`
        out = [(f"{body}embeddings.word_embeddings.weight", "embed_tokens.weight", (v, d)),
               (f"{body}embeddings.position_embeddings.weight", "pos_embed.weight", (cfg.max_seq_len, d)),
               (f"{body}embeddings.token_type_embeddings.weight", "token_type_embed.weight", (cfg.num_token_types, d)),
               (f"{body}embeddings.LayerNorm.weight", "embed_norm.weight", (d,)),
               (f"{body}embeddings.LayerNorm.bias", "embed_norm.bias", (d,))]
        for i in range(cfg.num_layers):
            h, t = f"{body}encoder.layer.{i}.", f"layers.{i}."
            for theirs, ours, shape in (("attention.self.query", "attn.q_proj", (d, d)),
                                        ("attention.self.key", "attn.k_proj", (d, d)),
                                        ("attention.self.value", "attn.v_proj", (d, d)),
                                        ("attention.output.dense", "attn.o_proj", (d, d)),
                                        ("attention.output.LayerNorm", "attn_norm", (d,)),
                                        ("intermediate.dense", "mlp.up_proj", (f, d)),
                                        ("output.dense", "mlp.down_proj", (d, f)),
                                        ("output.LayerNorm", "mlp_norm", (d,))):
                out.append((h + theirs + ".weight", t + ours + ".weight", shape))
                out.append((h + theirs + ".bias", t + ours + ".bias", shape[:1]))
        if cfg.pooler:
            out += [(f"{body}pooler.dense.weight", "pooler.dense.weight", (d, d)),
                    (f"{body}pooler.dense.bias", "pooler.dense.bias", (d,))]
        if cfg.mlm_head:
            out += [("cls.predictions.transform.dense.weight", "mlm_head.dense.weight", (d, d)),
                    ("cls.predictions.transform.dense.bias", "mlm_head.dense.bias", (d,)),
                    ("cls.predictions.transform.LayerNorm.weight", "mlm_head.norm.weight", (d,)),
                    ("cls.predictions.transform.LayerNorm.bias", "mlm_head.norm.bias", (d,)),
                    ("cls.predictions.bias", "mlm_head.decoder.bias", (v,))]
            if not cfg.tie_embeddings:
                out += [("cls.predictions.decoder.weight", "mlm_head.decoder.weight", (v, d)),
                        ("cls.predictions.decoder.bias", "mlm_head.decoder.bias", (v,))]
        if cfg.binary_head:
            out += [("cls.seq_relationship.weight", "binary_head.weight", (2, d)),
                    ("cls.seq_relationship.bias", "binary_head.bias", (2,))]
        return sorted(out)

    def export_rules(self, cfg: EncoderConfig) -> list[Rule]:
        return [Rule(theirs, (ours,), shape) for theirs, ours, shape in self.pairs(cfg)]

    def import_rules(self, cfg: EncoderConfig, hf_names: set[str]) -> list[Rule]:
        # Untied, the decoder's own bias is the one transformers' forward adds: read that one.
        skip = "cls.predictions.bias" if not cfg.tie_embeddings else None
        return [Rule(ours, (theirs,), shape) for theirs, ours, shape in self.pairs(cfg) if theirs != skip]


# transformers' pre-LayerNorm BERT (EncoderConfig.norm_placement = "pre"): same heads per class.
MEGATRON_CLASSES = {"Megatron" + name: heads for name, heads in CLASSES.items()}
# Post-LN name -> MegatronBert's (`attention.ln` before attention, the layer's `ln` before the MLP,
# the encoder's final `ln`; no embedding LayerNorm).
_PRE_LN_NAMES = {"attention.output.LayerNorm": "attention.ln", "output.LayerNorm": "ln"}


class MegatronBert(Bert):
    """transformers' MegatronBertModel / ForMaskedLM / ForPreTraining: BERT's tensors with the
    norms moved before attention and MLP and a final `encoder.ln` (config.json has no
    classifier_dropout)."""

    model_type = "megatron-bert"

    def config_fields(self, c: HFConfig) -> dict[str, Any]:
        archs = c.data.get("architectures")
        name = archs[0] if isinstance(archs, list) and archs else "MegatronBertModel"
        if name not in MEGATRON_CLASSES:
            c.fail("architectures", f"= {archs!r}: Tessera's encoder reads {', '.join(MEGATRON_CLASSES)} (not {name})")
        data = {**c.data, "architectures": [name.removeprefix("Megatron")]}
        return {**super().config_fields(HFConfig(data, c.source)), "norm_placement": "pre"}

    def hf_fields(self, cfg: EncoderConfig) -> dict[str, Any]:
        return {k: v for k, v in super().hf_fields(cfg).items() if k != "classifier_dropout"}

    def pairs(self, cfg: EncoderConfig) -> list[tuple[str, str, tuple[int, ...]]]:
        body = "bert." if cfg.mlm_head else ""
        out = []
        for theirs, ours, shape in super().pairs(cfg):
            if ours.startswith("embed_norm."):
                continue
            for post, pre in _PRE_LN_NAMES.items():
                theirs = theirs.replace(f".{post}.", f".{pre}.")
            out.append((theirs, ours, shape))
        d = cfg.hidden_size
        out += [(f"{body}encoder.ln.weight", "final_norm.weight", (d,)), (f"{body}encoder.ln.bias", "final_norm.bias", (d,))]
        return sorted(out)
