"""The `mlm` section of a training config: how BERT samples are cut and masked (Megatron's
--mask-prob, --short-seq-prob and its BERT dataset's masking settings). The binary head is the
model's (model.binary_head): with it, samples carry the sentence-order target."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from tessera.common.config import StrictModel


class MLMConfig(StrictModel):
    mask_prob: float = Field(0.15, gt=0, lt=1, description="Share of each sample's tokens that are predicted (Megatron's --mask-prob): 80% of them replaced by [MASK], 10% by a random token, 10% kept.")
    whole_word: bool = Field(True, description="Mask whole words: a WordPiece continuation (##…) is masked with the word it belongs to.")
    max_ngram: int = Field(3, ge=1, le=10, description="Masks are n-grams of up to this many words, n drawn with probability proportional to 1/n (Megatron's BERT: 3; 1 = single words, as Google's BERT).")
    binary_target: Literal["sentence_order", "next_sentence"] = Field("sentence_order", description="What the model's binary head predicts: sentence_order = whether A and B were swapped (Megatron's BERT, ALBERT); next_sentence = whether B comes from another document (Google's BERT, transformers' BertForPreTraining).")
    short_seq_prob: float = Field(0.1, ge=0, le=1, description="Probability that a sample is cut to a random shorter target length (Megatron's --short-seq-prob).")
