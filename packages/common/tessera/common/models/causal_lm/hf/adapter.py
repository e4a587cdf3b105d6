"""The causal LM's Hugging Face adapter: the architectures it maps to transformers, and the mapping
entry points the kind registry hands to import, export and serving (`ModelKind.hf`).

To add an architecture: write its `HFArchitecture` subclass in a module of this package and list
it in `ARCHITECTURES`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from tessera.common.errors import ArtifactError, UserError
from tessera.common.hf.architecture import HEAD, HF_DTYPE_NAMES, HFArchitecture, HFConfig
from tessera.common.hf.rules import Rule, rows, zero_rows
from tessera.common.models.causal_lm.config import ModelConfig
from tessera.common.models.causal_lm.hf.deepseek_v3 import DeepseekV3
from tessera.common.models.causal_lm.hf.gpt2 import GPT2
from tessera.common.models.causal_lm.hf.llama import Llama
from tessera.common.models.causal_lm.hf.mistral import Mistral
from tessera.common.models.causal_lm.hf.mixtral import Mixtral
from tessera.common.models.causal_lm.hf.qwen2 import Qwen2
from tessera.common.models.causal_lm.hf.qwen3 import Qwen3
from tessera.common.models.causal_lm.hf.qwen3_moe import Qwen3Moe

# Tessera parameters with one row per vocabulary entry (and padding rows past the vocabulary).
VOCAB_PARAMS = ("embed_tokens.weight", "lm_head.weight")

ARCHITECTURES: tuple[HFArchitecture, ...] = (Llama(), GPT2(), Mistral(), Qwen2(), Qwen3(), Mixtral(), Qwen3Moe(),
                                             DeepseekV3())


def supported() -> str:
    return ", ".join(f"{a.model_type} ({a.hf_class})" for a in ARCHITECTURES)


# transformers' causal-LM heads: a config.json naming one describes this kind (any family: one we
# do not map is then refused by `architecture_of`, naming its model_type).
CAUSAL_HEADS = ("ForCausalLM", "LMHeadModel")


def claims(data: dict[str, Any]) -> bool:
    """Whether config.json describes a causal LM: its `architectures` class is a causal-LM head, or
    its `model_type` is one of ours (a bare base-model save names no head; it loads as before)."""
    archs = data.get("architectures")
    head = isinstance(archs, list) and bool(archs) and isinstance(archs[0], str) and archs[0].endswith(CAUSAL_HEADS)
    return head or data.get("model_type") in {a.model_type for a in ARCHITECTURES}


def architecture_of(data: dict[str, Any], source: str) -> HFArchitecture:
    """The architecture a config.json describes (by `model_type`), or a one-line ArtifactError."""
    model_type = HFConfig(data, source).text("model_type")
    for a in ARCHITECTURES:
        if a.model_type == model_type:
            return a
    archs = data.get("architectures") or []
    named = ", ".join(map(str, archs)) if isinstance(archs, list) and archs else "no architectures"
    raise ArtifactError(f"{source}: unsupported architecture {model_type!r} ({named}); Tessera reads {supported()}")


def architecture_for(cfg: ModelConfig) -> HFArchitecture:
    for a in ARCHITECTURES:
        if a.arch == cfg.arch:
            return a
    raise UserError(f"model config: arch={cfg.arch} has no Hugging Face mapping (supported: {supported()})")


def model_config_from_hf(data: dict[str, Any], source: str) -> ModelConfig:
    """The ModelConfig equivalent to an HF config.json; anything Tessera's model cannot express
    exactly (an unknown architecture, an unsupported option, a malformed field) is an ArtifactError."""
    if not isinstance(data, dict):
        raise ArtifactError(f"{source}: expected a JSON object")
    return architecture_of(data, source).model_config(data, source, ModelConfig)


def hf_config(cfg: ModelConfig, dtype: torch.dtype, bos_id: int | None, eos_id: int | None,
              pad_id: int | None = None) -> dict[str, Any]:
    """config.json for `cfg`, with every field transformers, vLLM and TensorRT-LLM read."""
    arch = architecture_for(cfg)
    out: dict[str, Any] = {"architectures": [arch.hf_class], "model_type": arch.model_type, **arch.hf_fields(cfg)}
    out.update({
        "vocab_size": cfg.vocab_size,
        "initializer_range": cfg.init_std,
        "tie_word_embeddings": cfg.tie_embeddings,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "dtype": HF_DTYPE_NAMES[dtype],  # transformers >= 5
        "torch_dtype": HF_DTYPE_NAMES[dtype],  # older readers
        "use_cache": True,
    })
    if pad_id is not None:
        out["pad_token_id"] = pad_id
    return out


def check_exportable(cfg: ModelConfig) -> None:
    """Raise a UserError if `cfg` has no exact Hugging Face equivalent."""
    architecture_for(cfg).check_exportable(cfg)


def export_rules(cfg: ModelConfig) -> list[Rule]:
    """Tessera parameter names -> transformers tensors, one rule per transformers tensor. Vocabulary
    padding is cut off: transformers sees the tokenizer's vocab_size rows."""
    arch = architecture_for(cfg)
    arch.check_exportable(cfg)
    rules = arch.export_rules(cfg)
    if cfg.vocab_rows == cfg.vocab_size:
        return rules
    out = []
    for r in rules:
        if r.sources and r.sources[0] in VOCAB_PARAMS:
            assert r.combine is None and len(r.sources) == 1, r
            r = replace(r, combine=rows(0, cfg.vocab_size, transposed=False),
                        source_shapes=((cfg.vocab_rows, *r.shape[1:]),))
        out.append(r)
    return out


def import_rules(cfg: ModelConfig, hf_names: set[str]) -> tuple[list[Rule], frozenset[str]]:
    """(rules producing every Tessera parameter, names that may be present unread: a tied model's
    lm_head, which transformers ignores too). With `cfg` padded (ModelConfig.padded_for), the
    embedding and head get zero rows up to its vocab_rows."""
    arch = architecture_for(cfg)
    optional = frozenset({HEAD}) if cfg.tie_embeddings else frozenset()
    unread = getattr(arch, "unread_names", None)  # tensors of the family the model does not hold
    if unread is not None:
        optional |= unread(cfg, hf_names)
    rules = arch.import_rules(cfg, hf_names)
    if cfg.vocab_rows == cfg.vocab_size:
        return rules, optional
    out = []
    for r in rules:
        if r.target in VOCAB_PARAMS:
            assert r.combine is None and len(r.sources) == 1, r
            r = replace(r, shape=(cfg.vocab_rows, *r.shape[1:]), combine=zero_rows(cfg.vocab_rows - cfg.vocab_size),
                        source_shapes=(r.shape,))
        out.append(r)
    return out, optional
