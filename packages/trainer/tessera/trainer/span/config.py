"""The `span` section of a training config: how T5 samples are corrupted (T5's span corruption) and
the decoder's length. The encoder's input length is training.seq_length (Megatron's
--encoder-seq-length is its --seq-length; its --decoder-seq-length is `decoder_seq_length`)."""

from __future__ import annotations

from pydantic import Field

from tessera.common.config import StrictModel


class SpanConfig(StrictModel):
    noise_density: float = Field(0.15, gt=0, lt=1, description="Share of each sample's tokens that are corrupted (masked into spans and predicted by the decoder).")
    mean_span_length: float = Field(3.0, ge=1, description="Mean length of a corrupted span, in tokens; the sample's noise tokens are cut into round(noise / mean) spans.")
    decoder_seq_length: int = Field(128, gt=0, le=2**20, description="Decoder length: the target (sentinels, corrupted spans, EOS) padded to it (Megatron's --decoder-seq-length; T5: 114 for an encoder of 512).")
