"""The encoder-decoder's config: T5 as transformers' `T5ForConditionalGeneration` (T5: ReLU MLP,
tied head scaled by d_model**-0.5; v1.1: gated-GELU MLP, untied head).

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
    ModelConfig,
)
from tessera.common.models.encoder_decoder import layout_checks


class T5LayerConfig(ModelConfig):
    """The shared layers' view of T5: the causal LM's fields, with T5's MLPs allowed (relu: up /
    down; geglu: gelu_tanh(gate) * up, then down)."""

    activation: Literal["relu", "geglu"] = Field("relu", description="See T5Config.feed_forward.")  # type: ignore[assignment]


class T5Config(StrictModel):
    """Shape of a T5 encoder-decoder."""

    kind: Literal["encoder_decoder"] = Field("encoder_decoder", description="Model kind (tessera.common.models.registry); configs and checkpoints record it.")
    vocab_size: int = Field(..., gt=0, le=MAX_VOCAB, description="Token ids read and predicted, sentinels (<extra_id_N>) included (HF vocab_size, Megatron vocab_size before padding).")
    d_model: int = Field(..., gt=0, le=MAX_HIDDEN, description="Model width, in channels (HF d_model, Megatron hidden_size).")
    d_kv: int = Field(..., gt=0, le=MAX_HIDDEN, description="Channels of one attention head; need not be d_model / num_heads (HF d_kv, Megatron kv_channels).")
    d_ff: int = Field(..., gt=0, le=MAX_FFN, description="Inner width of the MLP, in channels; of each of the two input projections when gated (HF d_ff, Megatron ffn_hidden_size).")
    num_layers: int = Field(..., gt=0, le=MAX_LAYERS, description="Encoder blocks (HF num_layers, Megatron num_layers).")
    num_decoder_layers: int = Field(..., gt=0, le=MAX_LAYERS, description="Decoder blocks (HF num_decoder_layers; Megatron: the decoder config's num_layers).")
    num_heads: int = Field(..., gt=0, le=MAX_HEADS, description="Attention heads of every self- and cross-attention (HF num_heads, Megatron num_attention_heads).")
    relative_attention_num_buckets: int = Field(32, ge=4, le=2**12, description="Relative position buckets of the learned attention bias, held by the first block of each stack (the encoder's: half for keys before, half after; HF and Megatron relative_attention_num_buckets).")
    relative_attention_max_distance: int = Field(128, gt=1, le=2**20, description="Distance, in tokens, from which offsets share the last bucket; nearer ones are log-spaced up to it (HF and Megatron relative_attention_max_distance).")
    feed_forward: Literal["relu", "gated-gelu"] = Field("relu", description="MLP: relu = T5 (wi, ReLU, wo); gated-gelu = T5 v1.1 (tanh-GELU(wi_0) x wi_1, then wo; Megatron gated_linear_unit with gelu) (HF feed_forward_proj).")
    tie_word_embeddings: bool = Field(True, description="The head's weight is the shared embedding (T5; no lm_head tensor); false: its own head (T5 v1.1 as published) (HF tie_word_embeddings, Megatron share_embeddings_and_output_weights).")
    scale_decoder_outputs: bool | None = Field(None, description="The head scales its input by d_model**-0.5 (T5: true; v1.1: false); null = tie_word_embeddings (what transformers 4 configs implied), resolved when the config is read.")
    layer_norm_epsilon: float = Field(1e-6, gt=0, lt=1, description="Epsilon of every RMS norm (T5's LayerNorm has no mean or bias) (HF layer_norm_epsilon, Megatron layernorm_epsilon).")
    decoder_start_token_id: int = Field(0, ge=0, description="Token id of the first decoder input (T5: the pad id) (HF decoder_start_token_id).")
    pad_token_id: int = Field(0, ge=0, description="Token id of padding (HF pad_token_id); labels use -100 for ignored positions.")
    eos_token_id: int = Field(1, ge=0, description="Token id ending a sequence (T5's `</s>` is 1): closes encoder inputs and targets (HF eos_token_id).")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout probability on residual branches and embeddings (HF dropout_rate, Megatron hidden_dropout); 0 in Tessera's training (T5's pretraining used none).")
    initializer_factor: float = Field(1.0, gt=0, description="Multiplier of every init std of T5's scheme (HF initializer_factor).")

    @model_validator(mode="before")
    @classmethod
    def _expand_preset(cls, data: Any) -> Any:
        return expand_preset(data, PRESETS)

    @model_validator(mode="after")
    def _ids_in_vocab(self) -> T5Config:
        for name in ("decoder_start_token_id", "pad_token_id", "eos_token_id"):
            if getattr(self, name) >= self.vocab_size:
                raise ValueError(f"{name} {getattr(self, name)} is not below vocab_size {self.vocab_size}")
        if self.scale_decoder_outputs is None:  # resolved here, so configs compare by what the model does
            self.scale_decoder_outputs = self.tie_word_embeddings
        # Offsets below num_buckets / 2 (the decoder's; / 4 the encoder's) get a bucket each; the
        # rest are log-spaced up to max_distance, which must lie beyond them (else the log divides by 0).
        if self.relative_attention_max_distance <= self.relative_attention_num_buckets // 2:
            raise ValueError(f"relative_attention_max_distance ({self.relative_attention_max_distance}) must exceed "
                             f"relative_attention_num_buckets / 2 ({self.relative_attention_num_buckets // 2})")
        return self

    @property
    def scales_head(self) -> bool:
        return bool(self.scale_decoder_outputs)

    # ---- what the stages ask every kind ------------------------------------------------------
    @property
    def hidden_size(self) -> int:
        return self.d_model

    @property
    def arch(self) -> str:
        return "t5"

    @property
    def tie_embeddings(self) -> bool:
        return self.tie_word_embeddings

    @property
    def kv_heads(self) -> int:
        return self.num_heads

    @property
    def ffn_hidden_size(self) -> int:
        return self.d_ff

    @property
    def vocab_rows(self) -> int:
        return self.vocab_size  # never padded: exports keep T5's own row count

    @property
    def moe(self) -> None:
        return None

    @property
    def max_seq_len(self) -> int:
        """No position table: relative buckets take any length (what training.seq_length is checked against)."""
        return MAX_SEQ_LEN

    def layer_config(self) -> T5LayerConfig:
        """The config the shared attention, MLP and RMS norms are built from: no biases, no rotary
        embedding (T5's positions are the relative bias), heads of d_kv."""
        return T5LayerConfig(
            vocab_size=self.vocab_size, hidden_size=self.d_model, num_layers=max(self.num_layers, self.num_decoder_layers),
            num_heads=self.num_heads, head_dim=self.d_kv, ffn_hidden_size=self.d_ff, max_seq_len=self.max_seq_len,
            norm="rmsnorm", norm_eps=self.layer_norm_epsilon, position="learned", bias=False,
            activation="geglu" if self.feed_forward == "gated-gelu" else "relu", dropout=self.dropout,
            attention_dropout=self.dropout)

    # ---- accounting --------------------------------------------------------------------------
    # validate_layout's part for this kind (tessera.common.layout; what it lacks, its own modules' sizes).
    check_layout = layout_checks.check_layout

    def num_params(self) -> int:
        """Exact parameter count of `T5Model(self)` (tested against the real module)."""
        d, inner, v = self.d_model, self.num_heads * self.d_kv, self.vocab_size
        mlp = (3 if self.feed_forward == "gated-gelu" else 2) * d * self.d_ff
        stacks = 2 * (self.relative_attention_num_buckets * self.num_heads + d)  # bias tables, final norms
        enc = self.num_layers * (4 * d * inner + mlp + 2 * d)
        dec = self.num_decoder_layers * (8 * d * inner + mlp + 3 * d)
        return v * d * (1 if self.tie_word_embeddings else 2) + stacks + enc + dec

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs (forward + backward, PaLM convention as the other kinds) of one sample per
        encoder input token, the tokens the trainer counts (training.seq_length = `seq_len`):
        6 x the matmul weights each token goes through (encoder blocks and cross-attention k/v for
        input tokens; decoder blocks and the head for target tokens) + 12 x width x length per
        attention. The target length is what T5's default corruption (15% noise, spans of 3) makes
        of an input of `seq_len`: the noise and one sentinel per span, about 0.22 x seq_len."""
        d, inner, f, te = self.d_model, self.num_heads * self.d_kv, self.d_ff, seq_len
        td = max(1, round(0.2 * te / 0.9) + 1)  # raw = (te - 1) / (1 - 0.15 + 0.05); target = 0.2 x raw + EOS
        mlp = (3 if self.feed_forward == "gated-gelu" else 2) * d * f
        # Cross-attention's k/v project every encoder token once per decoder block.
        enc = te * (6.0 * (self.num_layers * (4 * d * inner + mlp) + self.num_decoder_layers * 2 * d * inner)
                    + 12.0 * self.num_layers * inner * te)
        dec = td * (6.0 * (self.num_decoder_layers * (6 * d * inner + mlp) + self.vocab_size * d)
                    + 12.0 * self.num_decoder_layers * inner * (td + te))
        return (enc + dec) / te


PRESETS: dict[str, dict[str, Any]] = {
    # Published shapes (google-t5/t5-base and google/t5-v1_1-xl config.json).
    "t5-base": dict(vocab_size=32128, d_model=768, d_kv=64, d_ff=3072, num_layers=12, num_decoder_layers=12,
                    num_heads=12, feed_forward="relu", tie_word_embeddings=True),
    "t5-v1_1-xl": dict(vocab_size=32128, d_model=2048, d_kv=64, d_ff=5120, num_layers=24, num_decoder_layers=24,
                       num_heads=32, feed_forward="gated-gelu", tie_word_embeddings=False),
}
