"""The `span` section of a training config: how T5 samples are corrupted (T5's span corruption;
Megatron's T5 dataset takes the same two numbers as --mask-prob and its mean n-gram length). The
encoder and decoder lengths are the model's (model.encoder_seq_len, model.decoder_seq_len)."""

from __future__ import annotations

from pydantic import Field

from tessera.common.config import StrictModel


class SpanConfig(StrictModel):
    noise_density: float = Field(0.15, gt=0, lt=1, description="Share of each sample's tokens that are corrupted (masked into spans and predicted by the decoder).")
    mean_span_length: float = Field(3.0, ge=1, description="Mean length of a corrupted span, in tokens; the sample's noise tokens are cut into round(noise / mean) spans.")
