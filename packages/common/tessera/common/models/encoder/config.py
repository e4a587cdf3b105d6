"""The encoder's config: BERT as transformers' `BertModel` / `BertForMaskedLM` / `BertForPreTraining`
and Megatron-Core's `BertModel` (word, absolute position and token-type embeddings, an embedding
LayerNorm, post-LayerNorm blocks of bidirectional attention and a GELU MLP; heads on top).

The heads a model has are three flags, and they decide which transformers class it is:
`pooler` (dense + tanh on the first token), `mlm_head` (masked-LM: dense + GELU + LayerNorm, then
the decoder, tied to the word embeddings, with its own bias) and `binary_head` (two logits from
the pooled token: next-sentence or sentence-order prediction). BertModel: pooler only;
BertForMaskedLM: mlm_head only; BertForPreTraining: all three (Megatron's BertModel without /
with its binary head are the last two).

The attention, MLP and norms are the shared layers (tessera.common.layers), which read a
causal-LM config: `layer_config` is that view of this config.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from tessera.common.config import StrictModel, expand_preset
from tessera.common.models.causal_lm.config import (
    MAX_FFN,
    MAX_HEADS,
    MAX_HIDDEN,
    MAX_LAYERS,
    MAX_SEQ_LEN,
    MAX_VOCAB,
    MAX_VOCAB_MULTIPLE,
    ModelConfig,
)

# Token types (segments) a model may embed: BERT has 2; far above any published encoder's.
MAX_TOKEN_TYPES = 2**10


class EncoderLayerConfig(ModelConfig):
    """The shared layers' view of an encoder: the causal LM's fields, with the erf GELU allowed
    (BERT's). Whole-model fields (vocabulary, positions, tying) are not read by the layers."""

    activation: Literal["gelu", "gelu_erf"] = Field("gelu_erf", description="See EncoderConfig.activation.")  # type: ignore[assignment]


class EncoderConfig(StrictModel):
    """Shape of a BERT-style encoder: embeddings, post-LayerNorm blocks, and the heads it has."""

    kind: Literal["encoder"] = Field("encoder", description="Model kind (tessera.common.models.registry); configs and checkpoints record it.")
    arch: Literal["bert"] = Field("bert", description="Family, which (with the heads) decides the Hugging Face class exports are written as (see docs/model.md).")
    vocab_size: int = Field(..., gt=0, le=MAX_VOCAB, description="Token ids the model reads and predicts: the tokenizer's vocabulary (what exports show; HF vocab_size, Megatron vocab_size before padding).")
    padded_vocab_size: int | None = Field(None, gt=0, le=MAX_VOCAB, description="Rows of the word embedding, the MLM decoder and its bias when more than vocab_size (set by `padded_for`); rows past vocab_size are zero and their logits -inf. null = vocab_size rows (Megatron padded_vocab_size).")
    vocab_size_divisible_by: int = Field(128, gt=0, le=MAX_VOCAB_MULTIPLE, description="Vocabulary padding rule (Megatron's --make-vocab-size-divisible-by): a new model's rows are vocab_size rounded up to a multiple of this x tensor-parallel size.")
    hidden_size: int = Field(..., gt=0, le=MAX_HIDDEN, description="Model width d, in channels (HF hidden_size, Megatron hidden_size).")
    num_layers: int = Field(..., gt=0, le=MAX_LAYERS, description="Number of transformer blocks (HF num_hidden_layers, Megatron num_layers).")
    num_heads: int = Field(..., gt=0, le=MAX_HEADS, description="Attention heads, each hidden_size / num_heads channels; divides hidden_size (HF num_attention_heads, Megatron num_attention_heads).")
    ffn_hidden_size: int = Field(..., gt=0, le=MAX_FFN, description="Inner width of the MLP, in channels (HF intermediate_size, Megatron ffn_hidden_size).")
    max_seq_len: int = Field(512, gt=0, le=MAX_SEQ_LEN, description="Rows of the absolute position table: the longest input, in tokens (HF and Megatron max_position_embeddings).")
    num_token_types: int = Field(2, ge=0, le=MAX_TOKEN_TYPES, description="Rows of the token-type (segment) table (HF type_vocab_size, Megatron num_tokentypes); 0 = no token-type embedding (Megatron without its binary head).")
    norm_eps: float = Field(1e-12, gt=0, description="Epsilon of every LayerNorm (HF layer_norm_eps, Megatron layernorm_epsilon).")
    norm_placement: Literal["post", "pre"] = Field("post", description="post = BERT's post-LayerNorm blocks and an embedding LayerNorm (transformers' Bert*); pre = LayerNorm before attention and before the MLP, a final LayerNorm, no embedding LayerNorm (transformers' MegatronBert*, Megatron-Core's BertModel layer specs).")
    activation: Literal["gelu_erf", "gelu"] = Field("gelu_erf", description="MLP and MLM-transform activation: gelu_erf = exact GELU (BERT's; HF hidden_act 'gelu'); gelu = tanh approximation (HF 'gelu_pytorch_tanh').")
    pooler: bool = Field(True, description="Pooler: dense + tanh on the first ([CLS]) token's hidden state (HF BertModel's add_pooling_layer; Megatron's Pooler, built with its binary head).")
    mlm_head: bool = Field(True, description="Masked-LM head: dense + activation + LayerNorm, then logits over the vocabulary with their own bias (HF cls.predictions, Megatron BertLMHead + output_layer).")
    binary_head: bool = Field(True, description="Binary head on the pooled token: next-sentence (BERT, HF cls.seq_relationship) or sentence-order (Megatron add_binary_head / --bert-binary-head) prediction; needs pooler.")
    tie_embeddings: bool = Field(True, description="The MLM decoder's weight is the word embedding (BERT's; HF tie_word_embeddings, Megatron share_embeddings_and_output_weights); false = its own matrix (no effect without mlm_head).")
    dropout: float = Field(0.1, ge=0, lt=1, description="Dropout probability on the embeddings and residual branches (HF hidden_dropout_prob, Megatron hidden_dropout).")
    attention_dropout: float = Field(0.1, ge=0, lt=1, description="Dropout probability on attention probabilities (HF attention_probs_dropout_prob, Megatron attention_dropout).")
    init_std: float = Field(0.02, gt=0, description="Std of the normal weight init (HF initializer_range, Megatron init_method_std).")

    @model_validator(mode="before")
    @classmethod
    def _expand_preset(cls, data: Any) -> Any:
        return expand_preset(data, PRESETS)

    @model_validator(mode="after")
    def _check(self) -> EncoderConfig:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must divide hidden_size ({self.hidden_size})")
        if self.padded_vocab_size is not None and self.padded_vocab_size < self.vocab_size:
            raise ValueError(f"padded_vocab_size ({self.padded_vocab_size}) is below vocab_size ({self.vocab_size})")
        if self.binary_head and not self.pooler:
            raise ValueError("binary_head needs pooler (it reads the pooled first token)")
        return self

    # ---- derived shape ---------------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def kv_heads(self) -> int:
        return self.num_heads

    @property
    def q_size(self) -> int:
        return self.hidden_size

    @property
    def moe(self) -> None:
        """No mixture-of-experts layers (what the layout checks ask a model)."""
        return None

    @property
    def vocab_rows(self) -> int:
        """Rows of the word embedding, the MLM decoder and its bias: the vocabulary plus padding."""
        return self.padded_vocab_size or self.vocab_size

    def padded_for(self, tensor_parallel: int) -> EncoderConfig:
        """Megatron's padding for a new model at `tensor_parallel` (as ModelConfig.padded_for)."""
        multiple = self.vocab_size_divisible_by * tensor_parallel
        rows = -(-self.vocab_size // multiple) * multiple
        return self.model_copy(update={"padded_vocab_size": rows if rows != self.vocab_size else None})

    def refit_for(self, tensor_parallel: int) -> EncoderConfig:
        """Itself when `tensor_parallel` divides its rows, else re-padded by `padded_for`."""
        return self if self.vocab_rows % tensor_parallel == 0 else self.padded_for(tensor_parallel)

    def layer_config(self) -> EncoderLayerConfig:
        """The config the shared attention and MLP layers and the LayerNorms are built from: biases
        everywhere, LayerNorm, no rotary embedding."""
        return EncoderLayerConfig(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, num_layers=self.num_layers,
            num_heads=self.num_heads, ffn_hidden_size=self.ffn_hidden_size, max_seq_len=self.max_seq_len,
            norm="layernorm", norm_eps=self.norm_eps, activation=self.activation, position="learned", bias=True,
            dropout=self.dropout, attention_dropout=self.attention_dropout, init_std=self.init_std)

    # ---- accounting --------------------------------------------------------------------------
    def num_params(self) -> int:
        """Exact parameter count of `EncoderModel(self)` (tested against the real module)."""
        d, f, v = self.hidden_size, self.ffn_hidden_size, self.vocab_rows
        total = (v + self.max_seq_len + self.num_token_types) * d + 2 * d  # embeddings, embedding (post) or final (pre) norm
        total += self.num_layers * (4 * d * d + 4 * d + 2 * d * f + f + d + 4 * d)  # attention, MLP, two norms
        if self.pooler:
            total += d * d + d
        if self.mlm_head:
            total += d * d + d + 2 * d + v + (0 if self.tie_embeddings else v * d)
        if self.binary_head:
            total += 2 * d + 2
        return total

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward), PaLM convention as the causal LM counts
        them: 6 x the matmul weights a token goes through (q/k/v/o, MLP, and with the MLM head its
        transform and the vocabulary decoder, computed for every token) + 12 x layers x width x
        seq_len for the attention scores and weighted sum. The pooler and binary head run once per
        sequence (not counted)."""
        d = self.hidden_size
        matmul = self.num_layers * (4 * d * d + 2 * d * self.ffn_hidden_size)
        if self.mlm_head:
            matmul += d * d + self.vocab_rows * d
        return 6.0 * matmul + 12.0 * self.num_layers * d * seq_len


PRESETS: dict[str, dict[str, Any]] = {
    # Published shapes (google-bert/bert-base-uncased and bert-large-uncased config.json).
    "bert-base": dict(vocab_size=30522, hidden_size=768, num_layers=12, num_heads=12, ffn_hidden_size=3072),
    "bert-large": dict(vocab_size=30522, hidden_size=1024, num_layers=24, num_heads=16, ffn_hidden_size=4096),
}
