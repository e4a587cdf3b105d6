"""T5 (transformers' `T5ForConditionalGeneration`, T5 and v1.1) <-> Tessera's encoder-decoder: the
HF adapter the kind registry hands to import, export and serving (`ModelKind.hf`; the protocol is
tessera.common.models.kind.HFAdapter).

Facts (transformers 5.24 is the reference; the tests compare logits and exported bytes with it):
every projection is a bias-free nn.Linear named q/k/v/o (attention) and wi/wo or wi_0/wi_1/wo (MLP,
wi_0 the GELU gate); each stack's relative-bias table sits on its first block's self-attention.
transformers 5 ties `encoder.embed_tokens` and `decoder.embed_tokens` to `shared` and saves only
`shared.weight` (older saves may carry the two aliases: accepted, unread); it always writes
`tie_word_embeddings: true` and saves `lm_head.weight` only when the head differs from `shared`
(T5 v1.1 as published), so whether the head is its own is read from the weights' names; the head's
d_model**-0.5 input scaling is `scale_decoder_outputs` (absent in transformers 4 configs: true
unless `tie_word_embeddings` is false). `save_pretrained` writes config.json with sorted keys and
the tensors sorted by name; `hf_config` writes the keys transformers writes for a T5Config.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError
from safetensors import SafetensorError, safe_open

from tessera.common.errors import ArtifactError
from tessera.common.fileio import artifact_path
from tessera.common.hf.architecture import HF_DTYPE_NAMES, HFConfig
from tessera.common.hf.rules import Rule
from tessera.common.models.encoder_decoder.config import T5Config
from tessera.common.models.encoder_decoder.hf_names import hf_name
from tessera.common.models.encoder_decoder.model import model_tensor_shapes

HF_CLASS, MODEL_TYPE = "T5ForConditionalGeneration", "t5"
TRANSFORMERS_VERSION = "5.24.0"  # whose save_pretrained this mapping reproduces byte for byte
HEAD = "lm_head.weight"
ALIASES = frozenset({"encoder.embed_tokens.weight", "decoder.embed_tokens.weight"})
_FEED_FORWARD = ("relu", "gated-gelu")


def supported() -> str:
    return f"t5 ({HF_CLASS}: T5 and T5 v1.1)"


def claims(data: dict[str, Any]) -> bool:
    archs = data.get("architectures")
    named = isinstance(archs, list) and bool(archs) and archs[0] == HF_CLASS
    return named or data.get("model_type") == MODEL_TYPE


def _head_in_weights(source: str) -> bool | None:
    """Whether the directory beside config.json `source` saves its own lm_head.weight (None: no
    weights to ask, e.g. a config read on its own). Only the names are read (the index, or the
    single file's header, by the safetensors library); damaged files are left to the weight
    reader, which refuses them by name."""
    path = Path(source)
    if path.name != "config.json" or not path.parent.is_dir():
        return None
    try:
        index = artifact_path(path.parent, "model.safetensors.index.json")  # no link out of the folder
        if index.is_file():
            weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
            return HEAD in weight_map if isinstance(weight_map, dict) else None
        single = artifact_path(path.parent, "model.safetensors")
        if single.is_file():
            with safe_open(str(single), "pt") as f:
                return HEAD in f.keys()
    except (OSError, ValueError, AttributeError, SafetensorError, ArtifactError):
        return None
    return None


def model_config_from_hf(data: dict[str, Any], source: str) -> T5Config:
    """The T5Config equivalent to an HF config.json; what the model cannot express exactly is an
    ArtifactError naming `source` and the field."""
    if not isinstance(data, dict):
        raise ArtifactError(f"{source}: expected a JSON object")
    c = HFConfig(data, source)
    archs = data.get("architectures")
    if isinstance(archs, list) and archs and archs[0] != HF_CLASS:
        c.fail("architectures", f"= {archs!r}: Tessera's encoder-decoder reads {HF_CLASS} only")
    if c.text("model_type") != MODEL_TYPE:
        c.fail("model_type", f"= {data.get('model_type')!r} does not match {HF_CLASS}")
    ff = c.text("feed_forward_proj", "relu")
    c.require("feed_forward_proj", ff, _FEED_FORWARD, "Tessera's T5 has the ReLU MLP (T5) and the gated GELU (v1.1)")
    c.require("is_encoder_decoder", c.flag("is_encoder_decoder", True), (True,), "T5ForConditionalGeneration is an encoder-decoder")
    c.require("is_decoder", c.flag("is_decoder", False), (False,), "a T5 decoder alone is not a model Tessera reads")
    tied_cfg = c.flag("tie_word_embeddings", True)
    own_head = _head_in_weights(source)
    tied = tied_cfg if own_head is None else not own_head
    scale = data.get("scale_decoder_outputs")
    if scale is None:
        scale = tied_cfg
    elif not isinstance(scale, bool):
        c.fail("scale_decoder_outputs", f"must be true or false, got {scale!r}")
    layers = c.integer("num_layers")
    fields = dict(
        vocab_size=c.integer("vocab_size"), d_model=c.integer("d_model"), d_kv=c.integer("d_kv"),
        d_ff=c.integer("d_ff"), num_layers=layers, num_decoder_layers=c.integer("num_decoder_layers", layers),
        num_heads=c.integer("num_heads"),
        relative_attention_num_buckets=c.integer("relative_attention_num_buckets", 32),
        relative_attention_max_distance=c.integer("relative_attention_max_distance", 128),
        feed_forward=ff, tie_word_embeddings=tied, scale_decoder_outputs=scale,
        layer_norm_epsilon=c.number("layer_norm_epsilon", 1e-6, positive=True),
        decoder_start_token_id=c.integer("decoder_start_token_id", 0, positive=False),
        pad_token_id=c.integer("pad_token_id", 0, positive=False),
        eos_token_id=c.integer("eos_token_id", 1, positive=False),
        dropout=c.number("dropout_rate", 0.1), initializer_factor=c.number("initializer_factor", 1.0, positive=True))
    try:
        return T5Config(**fields)
    except ValidationError as exc:  # one line naming the field
        err = exc.errors()[0]
        where = ".".join(map(str, err["loc"]))
        raise ArtifactError(f"{source}: {'model ' + where + ': ' if where else ''}{err['msg']}") from None


def hf_config(cfg: T5Config, dtype: torch.dtype, bos_id: int | None, eos_id: int | None,
              pad_id: int | None = None) -> dict[str, Any]:
    """config.json for `cfg`: the fields transformers' save_pretrained writes for a T5Config. The
    special ids are the model's (T5 has no bos; its pad is the decoder start)."""
    del bos_id, eos_id, pad_id
    gated = cfg.feed_forward == "gated-gelu"
    return {
        "architectures": [HF_CLASS], "classifier_dropout": 0.0, "d_ff": cfg.d_ff, "d_kv": cfg.d_kv,
        "d_model": cfg.d_model, "decoder_start_token_id": cfg.decoder_start_token_id,
        "dense_act_fn": "gelu_new" if gated else "relu", "dropout_rate": cfg.dropout, "dtype": HF_DTYPE_NAMES[dtype],
        "eos_token_id": cfg.eos_token_id, "feed_forward_proj": cfg.feed_forward,
        "initializer_factor": cfg.initializer_factor, "is_decoder": False, "is_encoder_decoder": True,
        "is_gated_act": gated, "layer_norm_epsilon": cfg.layer_norm_epsilon, "model_type": MODEL_TYPE,
        "num_decoder_layers": cfg.num_decoder_layers, "num_heads": cfg.num_heads, "num_layers": cfg.num_layers,
        "pad_token_id": cfg.pad_token_id, "relative_attention_max_distance": cfg.relative_attention_max_distance,
        "relative_attention_num_buckets": cfg.relative_attention_num_buckets,
        "scale_decoder_outputs": cfg.scales_head,
        "tie_word_embeddings": True,  # transformers 5 writes true always; an own head is saved as lm_head.weight
        "transformers_version": TRANSFORMERS_VERSION, "use_cache": True, "vocab_size": cfg.vocab_size,
    }


def generation_config(cfg: T5Config) -> dict[str, Any]:
    """generation_config.json as transformers writes it for T5 (decoding starts at the pad id)."""
    return {"_from_model_config": True, "decoder_start_token_id": cfg.decoder_start_token_id,
            "eos_token_id": cfg.eos_token_id, "output_attentions": False, "output_hidden_states": False,
            "pad_token_id": cfg.pad_token_id, "transformers_version": TRANSFORMERS_VERSION, "use_cache": True}


def check_exportable(cfg: T5Config) -> None:
    """Every T5Config has an exact T5ForConditionalGeneration equivalent."""
    del cfg


def _pairs(cfg: T5Config) -> list[tuple[str, str, tuple[int, ...]]]:
    gated = cfg.feed_forward == "gated-gelu"
    return sorted((hf_name(n, gated), n, s) for n, s in model_tensor_shapes(cfg).items())


def export_rules(cfg: T5Config) -> list[Rule]:
    """Tessera names -> transformers tensors, one rule per tensor transformers saves, by name."""
    return [Rule(theirs, (ours,), shape) for theirs, ours, shape in _pairs(cfg)]


def import_rules(cfg: T5Config, hf_names: set[str]) -> tuple[list[Rule], frozenset[str]]:
    """(rules producing every Tessera tensor, names that may be present unread: the embedding
    aliases older transformers saved)."""
    del hf_names
    return [Rule(ours, (theirs,), shape) for theirs, ours, shape in _pairs(cfg)], ALIASES
