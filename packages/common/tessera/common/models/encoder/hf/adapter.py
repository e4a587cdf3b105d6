"""The encoder's Hugging Face adapter: the transformers classes it maps (BertModel, BertForMaskedLM,
BertForPreTraining) and the mapping entry points the kind registry hands to import, export and
serving (`ModelKind.hf`). Same protocol as the causal LM's (tessera.common.models.kind.HFAdapter).

Vocabulary padding (EncoderConfig.padded_for) is cut off on export and added back (zero rows) on
import, for the word embedding and the MLM decoder's tensors alike.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from tessera.common.errors import ArtifactError
from tessera.common.hf.architecture import HF_DTYPE_NAMES, HFConfig
from tessera.common.hf.rules import Rule, rows, zero_rows
from tessera.common.models.encoder.config import EncoderConfig
from tessera.common.models.encoder.hf.bert import (
    CLASSES,
    MEGATRON_CLASSES,
    TRANSFORMERS_VERSION,
    Bert,
    MegatronBert,
    class_for,
)
from tessera.common.models.encoder.model import VOCAB_PARAMS

BERT = Bert()
MEGATRON_BERT = MegatronBert()  # norm_placement = "pre"


def _arch(cfg: EncoderConfig) -> Bert:
    return MEGATRON_BERT if cfg.norm_placement == "pre" else BERT
# An encoder is not generated from: exports have no generation_config.json (transformers writes
# none for these classes).
GENERATES = False


def supported() -> str:
    return f"bert ({', '.join(CLASSES)}), megatron-bert ({', '.join(MEGATRON_CLASSES)})"


def claims(data: dict[str, Any]) -> bool:
    """Whether config.json is one of ours: a BERT class we map, or model_type bert (a BERT class we
    do not map, e.g. BertLMHeadModel, is then refused by name rather than read as another kind)."""
    archs = data.get("architectures")
    named = isinstance(archs, list) and bool(archs) and (archs[0] in CLASSES or archs[0] in MEGATRON_CLASSES)
    return named or data.get("model_type") in (BERT.model_type, MEGATRON_BERT.model_type)


def model_config_from_hf(data: dict[str, Any], source: str) -> EncoderConfig:
    """The EncoderConfig equivalent to an HF config.json; what the model cannot express exactly is
    an ArtifactError naming `source` and the field."""
    if not isinstance(data, dict):
        raise ArtifactError(f"{source}: expected a JSON object")
    model_type = HFConfig(data, source).text("model_type")
    archs = data.get("architectures")
    megatron = isinstance(archs, list) and bool(archs) and archs[0] in MEGATRON_CLASSES
    arch = MEGATRON_BERT if megatron or (not archs and model_type == MEGATRON_BERT.model_type) else BERT
    if model_type != arch.model_type:
        raise ArtifactError(f"{source}: model_type {model_type!r} does not match its architectures "
                            f"{archs}; Tessera's encoder kind reads {supported()}")
    return arch.model_config(data, source, EncoderConfig)


def hf_config(cfg: EncoderConfig, dtype: torch.dtype, bos_id: int | None, eos_id: int | None,
              pad_id: int | None = None) -> dict[str, Any]:
    """config.json for `cfg`: exactly the fields transformers' save_pretrained writes for the class.
    BERT marks sequences with [CLS]/[SEP], not bos/eos: those stay None as in BERT's own configs
    (a tokenizer's bos/eos are not the model's), while the tokenizer's pad id is the config's."""
    del bos_id, eos_id
    arch = _arch(cfg)
    arch.check_exportable(cfg)
    name = ("Megatron" if arch is MEGATRON_BERT else "") + str(class_for(cfg))
    return {"architectures": [name], "model_type": arch.model_type, **arch.hf_fields(cfg),
            "vocab_size": cfg.vocab_size, "initializer_range": cfg.init_std, "tie_word_embeddings": cfg.tie_embeddings,
            "bos_token_id": None, "eos_token_id": None, "pad_token_id": pad_id, "dtype": HF_DTYPE_NAMES[dtype],
            "use_cache": True, "transformers_version": TRANSFORMERS_VERSION}


def check_exportable(cfg: EncoderConfig) -> None:
    """Raise a UserError if `cfg` has no exact Hugging Face equivalent."""
    _arch(cfg).check_exportable(cfg)


def export_rules(cfg: EncoderConfig) -> list[Rule]:
    """Tessera parameter names -> transformers tensors, one rule per transformers tensor, in the
    order transformers saves them; vocabulary padding cut off."""
    _arch(cfg).check_exportable(cfg)
    out = []
    for r in _arch(cfg).export_rules(cfg):
        if cfg.vocab_rows != cfg.vocab_size and r.sources[0] in VOCAB_PARAMS:
            r = replace(r, combine=rows(0, cfg.vocab_size, transposed=False),
                        source_shapes=((cfg.vocab_rows, *r.shape[1:]),))
        out.append(r)
    return out


def import_rules(cfg: EncoderConfig, hf_names: set[str]) -> tuple[list[Rule], frozenset[str]]:
    """(rules producing every Tessera parameter, names that may be present unread: an untied
    model's unused `cls.predictions.bias`); vocabulary tensors padded to cfg.vocab_rows."""
    optional = frozenset() if cfg.tie_embeddings else frozenset({"cls.predictions.bias"})
    out = []
    for r in _arch(cfg).import_rules(cfg, hf_names):
        if cfg.vocab_rows != cfg.vocab_size and r.target in VOCAB_PARAMS:
            r = replace(r, shape=(cfg.vocab_rows, *r.shape[1:]), combine=zero_rows(cfg.vocab_rows - cfg.vocab_size),
                        source_shapes=(r.shape,))
        out.append(r)
    return out, optional
