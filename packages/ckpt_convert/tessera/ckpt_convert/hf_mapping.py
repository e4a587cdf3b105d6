"""Tessera <-> Hugging Face transformers: tensor names, layouts and config.json, for Llama and GPT-2.

A conversion is a list of `Rule`s, one per output tensor: which input tensors it needs and how
they combine. Converters stream through the rules, so memory holds one rule's tensors at a time.
A rule may return a view (a transpose, a row range): the writers materialise non-contiguous
results in a reused staging buffer, so no rule allocates a copy of its own.

Facts encoded here (transformers' own modelling code is the reference; the parity tests load the
result with transformers and compare logits):
- Llama (`LlamaForCausalLM`): names map one to one; q/k/v/o, gate/up/down are [out, in] like ours;
  RoPE uses the same rotate-half layout, so no row permutation. Tied models store no lm_head.
- GPT-2 (`GPT2LMHeadModel`): Conv1D layers store weights transposed ([in, out]); attention is
  one fused `c_attn` = [q; k; v] along the output dimension; MLP is c_fc (up) and c_proj (down).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from tessera.common.errors import UserError
from tessera.common.model_config import ModelConfig, RopeScaling

Combine = Callable[[list[torch.Tensor]], torch.Tensor]


@dataclass(frozen=True)
class Rule:
    """One output tensor: `target` = combine(inputs named `sources`), of global `shape`."""

    target: str
    sources: tuple[str, ...]
    shape: tuple[int, ...]
    combine: Combine | None = None  # None: the single source, unchanged

    def apply(self, inputs: list[torch.Tensor]) -> torch.Tensor:
        out = inputs[0] if self.combine is None else self.combine(inputs)
        if tuple(out.shape) != self.shape:
            raise AssertionError(f"{self.target}: produced shape {tuple(out.shape)}, expected {self.shape}")
        return out


def _transpose(ts: list[torch.Tensor]) -> torch.Tensor:
    return ts[0].t()


def _cat_rows_t(ts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(ts, dim=0).t()


def _cat(ts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(ts, dim=0)


def _zeros(shape: tuple[int, ...]) -> Combine:
    return lambda _ts: torch.zeros(shape)


def _rows(lo: int, hi: int, transpose: bool) -> Combine:
    def take(ts: list[torch.Tensor]) -> torch.Tensor:
        t = ts[0].t() if transpose else ts[0]
        return t[lo:hi]
    return take


# ---- which Tessera configs each HF architecture can express ------------------------------------


def check_exportable(cfg: ModelConfig) -> None:
    """Raise a UserError if `cfg` has no exact Hugging Face equivalent."""
    if cfg.arch == "llama":
        wrong = {k: v for k, v in (("norm", cfg.norm), ("activation", cfg.activation), ("position", cfg.position))
                 if v != {"norm": "rmsnorm", "activation": "swiglu", "position": "rope"}[k]}
        if wrong:
            raise UserError(f"model config: arch=llama with {wrong} has no LlamaForCausalLM equivalent "
                            "(needs norm=rmsnorm, activation=swiglu, position=rope)")
    else:
        wrong = {k: v for k, v in (("norm", cfg.norm), ("activation", cfg.activation), ("position", cfg.position))
                 if v != {"norm": "layernorm", "activation": "gelu", "position": "learned"}[k]}
        if wrong or cfg.kv_heads != cfg.num_heads:
            raise UserError(f"model config: arch=gpt2 with {wrong or 'grouped-query attention'} has no "
                            "GPT2LMHeadModel equivalent (needs layernorm, gelu, learned positions, num_kv_heads=num_heads)")


# ---- Tessera -> HF -------------------------------------------------------------------------------


def export_rules(cfg: ModelConfig) -> list[Rule]:
    check_exportable(cfg)
    return _llama_export(cfg) if cfg.arch == "llama" else _gpt2_export(cfg)


def _llama_export(cfg: ModelConfig) -> list[Rule]:
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
        rules.append(Rule("lm_head.weight", ("lm_head.weight",), (v, d)))
    return rules


def _gpt2_export(cfg: ModelConfig) -> list[Rule]:
    d, f, v = cfg.hidden_size, cfg.ffn_hidden_size, cfg.vocab_size
    rules = [Rule("transformer.wte.weight", ("embed_tokens.weight",), (v, d)),
             Rule("transformer.wpe.weight", ("pos_embed.weight",), (cfg.max_seq_len, d))]

    def bias(target: str, sources: tuple[str, ...], shape: tuple[int, ...], combine: Combine | None = None) -> Rule:
        # HF GPT-2 always has biases; a bias-free Tessera model exports exact zeros.
        if cfg.bias:
            return Rule(target, sources, shape, combine)
        return Rule(target, (), shape, _zeros(shape))

    for i in range(cfg.num_layers):
        t, h = f"layers.{i}.", f"transformer.h.{i}."
        for ours, theirs in (("attn_norm", "ln_1"), ("mlp_norm", "ln_2")):
            rules.append(Rule(h + f"{theirs}.weight", (t + f"{ours}.weight",), (d,)))
            rules.append(Rule(h + f"{theirs}.bias", (t + f"{ours}.bias",), (d,)))
        qkv = tuple(t + f"attn.{p}_proj" for p in "qkv")
        rules.append(Rule(h + "attn.c_attn.weight", tuple(s + ".weight" for s in qkv), (d, 3 * d), _cat_rows_t))
        rules.append(bias(h + "attn.c_attn.bias", tuple(s + ".bias" for s in qkv), (3 * d,), _cat))
        rules.append(Rule(h + "attn.c_proj.weight", (t + "attn.o_proj.weight",), (d, d), _transpose))
        rules.append(bias(h + "attn.c_proj.bias", (t + "attn.o_proj.bias",), (d,)))
        rules.append(Rule(h + "mlp.c_fc.weight", (t + "mlp.up_proj.weight",), (d, f), _transpose))
        rules.append(bias(h + "mlp.c_fc.bias", (t + "mlp.up_proj.bias",), (f,)))
        rules.append(Rule(h + "mlp.c_proj.weight", (t + "mlp.down_proj.weight",), (f, d), _transpose))
        rules.append(bias(h + "mlp.c_proj.bias", (t + "mlp.down_proj.bias",), (d,)))
    rules.append(Rule("transformer.ln_f.weight", ("final_norm.weight",), (d,)))
    rules.append(Rule("transformer.ln_f.bias", ("final_norm.bias",), (d,)))
    if not cfg.tie_embeddings:
        rules.append(Rule("lm_head.weight", ("lm_head.weight",), (v, d)))
    return rules


# ---- HF -> Tessera -------------------------------------------------------------------------------


def import_rules(cfg: ModelConfig, hf_names: set[str]) -> list[Rule]:
    """Inverse of `export_rules`. `hf_names` (tensors present) decides GPT-2's optional prefix."""
    if cfg.arch == "llama":
        # Llama names map one to one with identical shapes: invert the export rules.
        return [Rule(r.sources[0], (r.target,), r.shape) for r in _llama_export(cfg)]
    prefix = "transformer." if any(n.startswith("transformer.") for n in hf_names) else ""
    d, f, v = cfg.hidden_size, cfg.ffn_hidden_size, cfg.vocab_size

    def hf(name: str) -> str:
        return prefix + name

    rules = [Rule("embed_tokens.weight", (hf("wte.weight"),), (v, d)),
             Rule("pos_embed.weight", (hf("wpe.weight"),), (cfg.max_seq_len, d))]
    for i in range(cfg.num_layers):
        t, h = f"layers.{i}.", hf(f"h.{i}.")
        for ours, theirs in (("attn_norm", "ln_1"), ("mlp_norm", "ln_2")):
            rules.append(Rule(t + f"{ours}.weight", (h + f"{theirs}.weight",), (d,)))
            rules.append(Rule(t + f"{ours}.bias", (h + f"{theirs}.bias",), (d,)))
        for j, p in enumerate("qkv"):
            rules.append(Rule(t + f"attn.{p}_proj.weight", (h + "attn.c_attn.weight",), (d, d),
                              _rows(j * d, (j + 1) * d, transpose=True)))
            rules.append(Rule(t + f"attn.{p}_proj.bias", (h + "attn.c_attn.bias",), (d,),
                              _rows(j * d, (j + 1) * d, transpose=False)))
        rules.append(Rule(t + "attn.o_proj.weight", (h + "attn.c_proj.weight",), (d, d), _transpose))
        rules.append(Rule(t + "attn.o_proj.bias", (h + "attn.c_proj.bias",), (d,)))
        rules.append(Rule(t + "mlp.up_proj.weight", (h + "mlp.c_fc.weight",), (f, d), _transpose))
        rules.append(Rule(t + "mlp.up_proj.bias", (h + "mlp.c_fc.bias",), (f,)))
        rules.append(Rule(t + "mlp.down_proj.weight", (h + "mlp.c_proj.weight",), (d, f), _transpose))
        rules.append(Rule(t + "mlp.down_proj.bias", (h + "mlp.c_proj.bias",), (d,)))
    rules.append(Rule("final_norm.weight", (hf("ln_f.weight"),), (d,)))
    rules.append(Rule("final_norm.bias", (hf("ln_f.bias"),), (d,)))
    if not cfg.tie_embeddings:
        rules.append(Rule("lm_head.weight", ("lm_head.weight",), (v, d)))
    return rules


# ---- config.json ---------------------------------------------------------------------------------

HF_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def hf_config(cfg: ModelConfig, dtype: torch.dtype, bos_id: int | None, eos_id: int | None,
              pad_id: int | None = None) -> dict[str, Any]:
    """config.json for the exported model, with every field transformers/vLLM/TRT-LLM read."""
    common: dict[str, Any] = {
        "vocab_size": cfg.vocab_size,
        "initializer_range": cfg.init_std,
        "tie_word_embeddings": cfg.tie_embeddings,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "torch_dtype": HF_DTYPE_NAMES[dtype],
        "use_cache": True,
    }
    if pad_id is not None:
        common["pad_token_id"] = pad_id
    if cfg.arch == "llama":
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.ffn_hidden_size,
            "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_heads,
            "num_key_value_heads": cfg.kv_heads,
            "head_dim": cfg.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": cfg.max_seq_len,
            "rms_norm_eps": cfg.norm_eps,
            "rope_theta": cfg.rope_theta,
            "rope_scaling": cfg.rope_scaling.model_dump() if cfg.rope_scaling else None,
            "attention_bias": cfg.bias,
            "mlp_bias": cfg.bias,
            "attention_dropout": cfg.attention_dropout,
            "pretraining_tp": 1,
            **common,
        }
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
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
        **common,
    }


def model_config_from_hf(c: dict[str, Any], source: str) -> ModelConfig:
    """The ModelConfig equivalent to an HF config.json; unsupported architectures are a UserError."""
    model_type = c.get("model_type")
    archs = c.get("architectures") or []

    def need(key: str) -> Any:
        if key not in c or c[key] is None:
            raise UserError(f"{source}: field {key!r} missing; not a complete {model_type} config.json")
        return c[key]

    if model_type == "llama":
        if c.get("hidden_act", "silu") != "silu":
            raise UserError(f"{source}: hidden_act={c['hidden_act']!r} is not supported (Llama import needs silu)")
        if bool(c.get("attention_bias", False)) != bool(c.get("mlp_bias", False)):
            raise UserError(f"{source}: attention_bias and mlp_bias differ; Tessera has one bias flag for both")
        d, heads = need("hidden_size"), need("num_attention_heads")
        if c.get("head_dim") not in (None, d // heads):
            raise UserError(f"{source}: head_dim={c['head_dim']} differs from hidden_size/num_attention_heads; not supported")
        rope = c.get("rope_scaling")
        params = c.get("rope_parameters") or {}  # transformers >= 5 spelling
        theta = c.get("rope_theta", params.get("rope_theta", 10000.0))
        if rope is None and params.get("rope_type", "default") != "default":
            rope = params
        scaling = None
        if rope:
            kind = rope.get("rope_type", rope.get("type"))
            if kind == "default":
                scaling = None
            elif kind != "llama3":
                raise UserError(f"{source}: rope_scaling type {kind!r} is not supported (only llama3)")
            else:
                scaling = RopeScaling(factor=rope["factor"], low_freq_factor=rope["low_freq_factor"],
                                      high_freq_factor=rope["high_freq_factor"],
                                      original_max_position_embeddings=rope["original_max_position_embeddings"])
        return ModelConfig(
            arch="llama", vocab_size=need("vocab_size"), hidden_size=d, num_layers=need("num_hidden_layers"),
            num_heads=heads, num_kv_heads=c.get("num_key_value_heads") or heads,
            ffn_hidden_size=need("intermediate_size"), max_seq_len=c.get("max_position_embeddings", 2048),
            norm="rmsnorm", norm_eps=c.get("rms_norm_eps", 1e-6), activation="swiglu", position="rope",
            rope_theta=theta, rope_scaling=scaling, bias=bool(c.get("attention_bias", False)),
            tie_embeddings=bool(c.get("tie_word_embeddings", False)),
            attention_dropout=c.get("attention_dropout", 0.0) or 0.0,
            init_std=c.get("initializer_range", 0.02),
        )
    if model_type == "gpt2":
        act = c.get("activation_function", "gelu_new")
        if act not in ("gelu_new", "gelu_pytorch_tanh"):
            raise UserError(f"{source}: activation_function={act!r} is not supported (GPT-2 import needs gelu_new)")
        for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
            if c.get(flag):
                raise UserError(f"{source}: {flag}=true is not supported")
        if c.get("scale_attn_weights") is False:
            raise UserError(f"{source}: scale_attn_weights=false is not supported")
        d = need("n_embd")
        return ModelConfig(
            arch="gpt2", vocab_size=need("vocab_size"), hidden_size=d, num_layers=need("n_layer"),
            num_heads=need("n_head"), ffn_hidden_size=c.get("n_inner") or 4 * d,
            max_seq_len=need("n_positions"), norm="layernorm", norm_eps=c.get("layer_norm_epsilon", 1e-5),
            activation="gelu", position="learned", bias=True,
            tie_embeddings=bool(c.get("tie_word_embeddings", True)),
            dropout=c.get("resid_pdrop", 0.0) or 0.0, attention_dropout=c.get("attn_pdrop", 0.0) or 0.0,
            init_std=c.get("initializer_range", 0.02),
        )
    raise UserError(f"{source}: unsupported architecture {model_type!r} ({', '.join(archs) or 'no architectures'}); "
                    "tessera-ckpt imports Llama (LlamaForCausalLM) and GPT-2 (GPT2LMHeadModel)")
