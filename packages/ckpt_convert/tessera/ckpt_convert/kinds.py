"""Which conversions tessera-ckpt has for each model kind, under the hook name the kind registry
gives (tessera.common.models.registry). The Hugging Face mapping itself is the kind's adapter in
common; the TensorRT-LLM and Megatron mappings and resharding's partition rules live here.
`check_convertible` refuses a kind a conversion has no mapping for, in one line, as soon as the
input's config is read and before anything is written."""

from __future__ import annotations

from typing import Any

from tessera.common.models.registry import stage_hook

# Conversions per hook name. "decoder": the decoder-only stack (embedding, blocks, final norm, head).
# "hybrid": Mamba-2, attention, MLP and MoE layers in a pattern (no TensorRT-LLM mapping).
CONVERTERS: dict[str, frozenset[str]] = {
    "decoder": frozenset({"export --format hf", "export --format trtllm", "export --format megatron",
                          "import --format hf", "import --format megatron", "reshard"}),
    "hybrid": frozenset({"export --format hf", "export --format megatron", "import --format hf",
                         "import --format megatron", "reshard"}),
    # "encoder": BERT (embeddings with token types, post- or pre-norm blocks, pooler / MLM / binary heads;
    # Megatron's BertModel for pre-norm only: exporters/megatron_bert.py).
    "encoder": frozenset({"export --format hf", "export --format megatron", "import --format hf",
                          "import --format megatron", "reshard"}),
    # "encoder_decoder": T5 (T5ForConditionalGeneration, T5 and v1.1).
    "encoder_decoder": frozenset({"export --format hf", "import --format hf", "reshard"}),
    # "vision_language": LLaVA (vision tower, projector, a causal LM).
    "vision_language": frozenset({"export --format hf", "import --format hf", "reshard"}),
}


def check_convertible(model: Any, conversion: str) -> None:
    """`conversion` (e.g. "export --format trtllm") handles `model`'s kind, or a one-line UserError."""
    table = {name: verbs for name, verbs in CONVERTERS.items() if conversion in verbs}
    stage_hook(model, "convert", table, f"tessera-ckpt {conversion}")
