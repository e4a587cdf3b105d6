"""The model config: one typed description of every supported decoder, with named presets.

A single config covers GPT-2 (LayerNorm, learned positions, GELU, biases, tied embeddings) and
Llama 2/3 (RMSNorm, RoPE with theta and Llama-3 scaling, SwiGLU, grouped/multi-query attention,
untied head). The trainer, the converter and the server all build the model from this config,
and checkpoints and exports carry it in their sidecars.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from tessera.common.config import StrictModel


class RopeScaling(StrictModel):
    """Llama-3 style frequency-dependent RoPE scaling (HF `rope_type: llama3`)."""

    rope_type: Literal["llama3"] = Field("llama3", description="Scaling method; only llama3 is supported.")
    factor: float = Field(8.0, gt=0, description="Wavelength stretch applied to low frequencies.")
    low_freq_factor: float = Field(1.0, gt=0, description="Wavelengths above original/low_freq_factor are scaled fully.")
    high_freq_factor: float = Field(4.0, gt=0, description="Wavelengths below original/high_freq_factor are kept.")
    original_max_position_embeddings: int = Field(8192, gt=0, description="Context length the base model was trained at.")


class ModelConfig(StrictModel):
    """Shape and flavour of a decoder-only transformer."""

    arch: Literal["llama", "gpt2"] = Field("llama", description="Family, which decides export names (LlamaForCausalLM or GPT2LMHeadModel).")
    vocab_size: int = Field(..., gt=0, description="Token ids the model reads and predicts: the tokenizer's vocabulary (what exports show).")
    padded_vocab_size: int | None = Field(None, gt=0, description="Rows of the embedding and the output head when more than vocab_size (set by `padded_for`); the rows past vocab_size are zero-initialised and their logits are -inf. null = vocab_size rows.")
    vocab_size_divisible_by: int = Field(128, gt=0, description="Vocabulary padding rule (Megatron's --make-vocab-size-divisible-by): a new model's rows are vocab_size rounded up to a multiple of this x tensor-parallel size.")
    hidden_size: int = Field(..., gt=0, description="Model width d.")
    num_layers: int = Field(..., gt=0, description="Number of transformer blocks.")
    num_heads: int = Field(..., gt=0, description="Query heads.")
    num_kv_heads: int | None = Field(None, gt=0, description="Key/value heads (grouped-query attention); defaults to num_heads.")
    ffn_hidden_size: int = Field(..., gt=0, description="Inner width of the MLP.")
    max_seq_len: int = Field(2048, gt=0, description="Longest sequence the model handles (learned positions / RoPE cache).")
    norm: Literal["rmsnorm", "layernorm"] = Field("rmsnorm", description="Normalisation layer.")
    norm_eps: float = Field(1e-5, gt=0, description="Epsilon of the normalisation layers.")
    activation: Literal["swiglu", "gelu"] = Field("swiglu", description="MLP: SwiGLU (gate/up/down) or GELU (up/down, tanh approximation as GPT-2).")
    position: Literal["rope", "learned"] = Field("rope", description="Rotary embeddings or learned absolute positions.")
    rope_theta: float = Field(10000.0, gt=0, description="RoPE base frequency.")
    rope_scaling: RopeScaling | None = Field(None, description="Optional Llama-3 RoPE scaling.")
    bias: bool = Field(False, description="Biases on the attention and MLP linear layers (GPT-2: true).")
    tie_embeddings: bool = Field(False, description="Output head shares the input embedding matrix.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on embeddings and residual branches.")
    attention_dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on attention probabilities.")
    init_std: float = Field(0.02, gt=0, description="Std of the normal weight init; output projections are scaled by 1/sqrt(2*num_layers).")

    @model_validator(mode="before")
    @classmethod
    def _expand_preset(cls, data: Any) -> Any:
        if isinstance(data, dict) and "preset" in data:
            data = dict(data)
            name = data.pop("preset")
            if name not in PRESETS:
                raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
            data = {**PRESETS[name], **data}
        return data

    @model_validator(mode="after")
    def _check_shapes(self) -> ModelConfig:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must divide hidden_size ({self.hidden_size})")
        if self.num_heads % self.kv_heads:
            raise ValueError(f"num_kv_heads ({self.kv_heads}) must divide num_heads ({self.num_heads})")
        if self.padded_vocab_size is not None and self.padded_vocab_size < self.vocab_size:
            raise ValueError(f"padded_vocab_size ({self.padded_vocab_size}) is below vocab_size ({self.vocab_size})")
        if self.position == "rope" and self.head_dim % 2:
            raise ValueError(f"RoPE needs an even head dimension, got {self.head_dim}")
        return self

    # ---- derived shape -------------------------------------------------------------------
    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def vocab_rows(self) -> int:
        """Rows of the embedding and the head: the vocabulary plus its padding."""
        return self.padded_vocab_size or self.vocab_size

    def padded_for(self, tensor_parallel: int) -> ModelConfig:
        """This config with Megatron's padding for a new model at `tensor_parallel`: rows = vocab_size
        rounded up to a multiple of vocab_size_divisible_by x tensor_parallel.

        A model that exists already (a checkpoint) keeps its rows at every layout they divide, so
        checkpoints stay layout-free; `refit_for` re-pads only when the rows do not divide."""
        multiple = self.vocab_size_divisible_by * tensor_parallel
        rows = -(-self.vocab_size // multiple) * multiple
        return self.model_copy(update={"padded_vocab_size": rows if rows != self.vocab_size else None})

    def refit_for(self, tensor_parallel: int) -> ModelConfig:
        """Itself when `tensor_parallel` divides its rows, else re-padded by `padded_for`."""
        return self if self.vocab_rows % tensor_parallel == 0 else self.padded_for(tensor_parallel)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.kv_heads * self.head_dim

    # ---- accounting ----------------------------------------------------------------------
    def num_params(self, include_embedding: bool = True) -> int:
        """Exact parameter count of `Transformer(self)` (tested against the real module)."""
        d, f, v = self.hidden_size, self.ffn_hidden_size, self.vocab_rows
        norm_params = d * (2 if self.norm == "layernorm" else 1)
        attn = d * self.q_size + 2 * d * self.kv_size + self.q_size * d
        mlp = (3 if self.activation == "swiglu" else 2) * d * f
        if self.bias:
            attn += self.q_size + 2 * self.kv_size + d
            mlp += (2 * f if self.activation == "swiglu" else f) + d
        per_layer = attn + mlp + 2 * norm_params
        total = self.num_layers * per_layer + norm_params
        if include_embedding:
            total += v * d
            if self.position == "learned":
                total += self.max_seq_len * d
        if not self.tie_embeddings:
            total += v * d
        return total

    def matmul_params(self) -> int:
        """Weights that take part in matrix multiplies: projections, MLP and the output head.

        Excludes embedding lookups, norms and biases; the head counts even when tied.
        """
        d, f = self.hidden_size, self.ffn_hidden_size
        attn = d * self.q_size + 2 * d * self.kv_size + self.q_size * d
        mlp = (3 if self.activation == "swiglu" else 2) * d * f
        return self.num_layers * (attn + mlp) + self.vocab_rows * d

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward), PaLM convention.

        6 x matmul_params() + 12 x layers x query width x seq_len for the attention scores and
        weighted sum (not halved for causal masking, as is customary).
        """
        return 6.0 * self.matmul_params() + 12.0 * self.num_layers * self.q_size * seq_len


PRESETS: dict[str, dict[str, Any]] = {
    # Unit tests and the CPU demo: seconds per step on two cores.
    "tiny": dict(arch="llama", vocab_size=8192, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                 ffn_hidden_size=176, max_seq_len=256, norm="rmsnorm", activation="swiglu", position="rope"),
    "gpt2-124m": dict(arch="gpt2", vocab_size=50304, hidden_size=768, num_layers=12, num_heads=12,
                      ffn_hidden_size=3072, max_seq_len=1024, norm="layernorm", activation="gelu",
                      position="learned", bias=True, tie_embeddings=True, norm_eps=1e-5),
    "llama-160m": dict(arch="llama", vocab_size=32000, hidden_size=768, num_layers=12, num_heads=12,
                       num_kv_heads=12, ffn_hidden_size=3072, max_seq_len=2048, norm_eps=1e-6),
    "llama-1b": dict(arch="llama", vocab_size=128256, hidden_size=2048, num_layers=16, num_heads=32,
                     num_kv_heads=8, ffn_hidden_size=8192, max_seq_len=8192, rope_theta=500000.0,
                     rope_scaling=dict(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                       original_max_position_embeddings=8192),
                     tie_embeddings=True),
    "llama3-8b": dict(arch="llama", vocab_size=128256, hidden_size=4096, num_layers=32, num_heads=32,
                      num_kv_heads=8, ffn_hidden_size=14336, max_seq_len=8192, rope_theta=500000.0),
}


def preset(name: str, **overrides: Any) -> ModelConfig:
    """Build a config from a named preset with field overrides (e.g. vocab_size from the tokenizer)."""
    return ModelConfig.model_validate({"preset": name, **overrides})
