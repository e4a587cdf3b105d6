"""The encoder-decoder's config: T5 as transformers' `T5ForConditionalGeneration` (T5: ReLU MLP,
tied head scaled by d_model**-0.5; v1.1: gated-GELU MLP, untied head)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from tessera.common.config import StrictModel
from tessera.common.models.causal_lm.config import MAX_FFN, MAX_HEADS, MAX_HIDDEN, MAX_LAYERS, MAX_VOCAB


class T5Config(StrictModel):
    """Shape of a T5 encoder-decoder."""

    kind: Literal["encoder_decoder"] = Field("encoder_decoder", description="Model kind.")
    vocab_size: int = Field(..., gt=0, le=MAX_VOCAB, description="Token ids read and predicted, sentinels included.")
    d_model: int = Field(..., gt=0, le=MAX_HIDDEN, description="Hidden size.")
    d_kv: int = Field(..., gt=0, le=MAX_HIDDEN, description="Size of one attention head (need not be d_model / num_heads).")
    d_ff: int = Field(..., gt=0, le=MAX_FFN, description="MLP inner size.")
    num_layers: int = Field(..., gt=0, le=MAX_LAYERS, description="Encoder blocks.")
    num_decoder_layers: int = Field(..., gt=0, le=MAX_LAYERS, description="Decoder blocks.")
    num_heads: int = Field(..., gt=0, le=MAX_HEADS, description="Attention heads.")
    relative_attention_num_buckets: int = Field(32, gt=1, le=2**12, description="Relative position buckets.")
    relative_attention_max_distance: int = Field(128, gt=1, le=2**20, description="Distance mapped to the last bucket.")
    feed_forward: Literal["relu", "gated-gelu"] = Field("relu", description="relu: T5; gated-gelu: T5 v1.1 (tanh GELU gate).")
    tie_word_embeddings: bool = Field(True, description="Head shares the embedding and scales its input by d_model**-0.5 (T5); false: its own head (v1.1).")
    layer_norm_epsilon: float = Field(1e-6, gt=0, lt=1, description="RMS norm epsilon.")
    decoder_start_token_id: int = Field(0, ge=0, description="First decoder input (T5: the pad id).")
    pad_token_id: int = Field(0, ge=0, description="Pad id; labels use -100 for ignored positions.")

    @model_validator(mode="after")
    def _ids_in_vocab(self) -> T5Config:
        for name in ("decoder_start_token_id", "pad_token_id"):
            if getattr(self, name) >= self.vocab_size:
                raise ValueError(f"{name} {getattr(self, name)} is not below vocab_size {self.vocab_size}")
        return self
