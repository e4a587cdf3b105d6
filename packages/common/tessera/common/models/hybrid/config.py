"""The hybrid model's config: Megatron's HybridModel layer pattern over Mamba-2, attention, MLP and
MoE layers (Nemotron-H; Mamba2 is the all-`M` pattern).

`pattern` is Megatron's hybrid override pattern, one symbol per layer: `M` Mamba-2 mixer, `*`
self-attention, `-` MLP, `E` mixture of experts. Each layer is one of these behind its own
pre-norm and residual (Megatron's MambaStack, transformers' NemotronHBlock). A section is
needed exactly for the symbols the pattern uses: `mamba` for M; num_heads for *; ffn_hidden_size
for -; `moe` (the causal LM's MoEConfig, so both kinds route alike) for E.

The attention, MLP and MoE layers are the causal LM's (tessera.common.layers), which read a
causal-LM config: `layer_config` is that view of this config.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from tessera.common.config import StrictModel, expand_preset
from tessera.common.models.causal_lm.config import (
    MAX_FFN,
    MAX_HEAD_DIM,
    MAX_HEADS,
    MAX_HIDDEN,
    MAX_LAYERS,
    MAX_SEQ_LEN,
    MAX_VOCAB,
    ModelConfig,
    MoEConfig,
)
from tessera.common.models.hybrid import layout_checks

SYMBOLS = {"M": "Mamba-2", "*": "attention", "-": "MLP", "E": "MoE"}
# Upper bounds of the Mamba sizes (the others are the causal LM's): far above every published model
# (state 128-256, conv 4, groups 8), low enough that nothing sized by them is allocated from a
# hostile config.
MAX_STATE = 2**12
MAX_CONV_KERNEL = 2**8


class MambaConfig(StrictModel):
    """The Mamba-2 mixers (Megatron's MambaMixer, transformers' Mamba2Mixer): heads of head_dim
    channels, num_groups groups of B and C state projections shared by the heads of a group."""

    num_heads: int = Field(..., gt=0, le=MAX_HEADS, description="SSM heads (Megatron mamba_num_heads; HF Mamba2 num_heads, NemotronH mamba_num_heads); the inner width is num_heads x head_dim channels.")
    head_dim: int = Field(64, gt=0, le=MAX_HEAD_DIM, description="Channels per head (Megatron mamba_head_dim; HF Mamba2 head_dim, NemotronH mamba_head_dim).")
    state_size: int = Field(128, gt=0, le=MAX_STATE, description="State size N per channel (Megatron mamba_state_dim, HF ssm_state_size).")
    num_groups: int = Field(8, gt=0, le=MAX_HEADS, description="Groups of B and C (Megatron mamba_num_groups, HF n_groups); divides num_heads.")
    conv_kernel: int = Field(4, gt=0, le=MAX_CONV_KERNEL, description="Taps (tokens) of the causal depthwise convolution (Megatron d_conv, HF conv_kernel).")
    conv_bias: bool = Field(True, description="Bias on the convolution (HF use_conv_bias, Megatron conv_bias).")
    bias: bool = Field(False, description="Biases on the input and output projections (HF use_bias).")
    chunk_size: int = Field(128, gt=0, le=MAX_SEQ_LEN, description="Tokens per chunk of the chunked scan, a speed setting: results are the same (HF chunk_size, Megatron chunk_size).")
    dt_min: float = Field(0.001, gt=0, description="Initialisation: softplus(dt_bias) drawn log-uniformly in [dt_min, dt_max], a step size per head (HF time_step_min, Megatron dt_min).")
    dt_max: float = Field(0.1, gt=0, description="Initialisation: upper end of softplus(dt_bias) (HF time_step_max, Megatron dt_max).")
    dt_init_floor: float = Field(1e-4, gt=0, description="Initialisation: softplus(dt_bias) at least this (HF time_step_floor, Megatron dt_init_floor).")
    dt_limit_min: float = Field(0.0, ge=0, description="The step softplus(dt + dt_bias) is clamped to at least this (transformers' Nemotron-H: time_step_min).")
    dt_limit_max: float | None = Field(None, gt=0, description="...and at most this; null = no upper limit (HF time_step_limit's upper end).")

    @model_validator(mode="after")
    def _check(self) -> MambaConfig:
        if self.num_heads % self.num_groups:
            raise ValueError(f"num_groups ({self.num_groups}) must divide num_heads ({self.num_heads})")
        if self.dt_min > self.dt_max:
            raise ValueError(f"dt_min ({self.dt_min}) exceeds dt_max ({self.dt_max})")
        if self.dt_limit_max is not None and self.dt_limit_max < self.dt_limit_min:
            raise ValueError(f"dt_limit_max ({self.dt_limit_max}) is below dt_limit_min ({self.dt_limit_min})")
        return self

    @property
    def inner_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def group_width(self) -> int:
        """Width of B (and of C): num_groups x state_size."""
        return self.num_groups * self.state_size


class LayerConfig(ModelConfig):
    """The shared layers' view of a hybrid model (they read a causal-LM config): the causal LM's
    fields, with squared ReLU allowed for the MLP and the experts. Whole-model fields (vocabulary,
    positions, tying) are not read by the layers."""

    activation: Literal["swiglu", "gelu", "squared_relu"] = Field("swiglu", description="See ModelConfig; squared_relu: up/down, relu(x)^2.")  # type: ignore[assignment]


class HybridConfig(StrictModel):
    """Shape of a hybrid state-space model: embedding, the layers of `pattern`, final RMSNorm, head."""

    kind: Literal["hybrid"] = Field("hybrid", description="Model kind (tessera.common.models.registry); configs and checkpoints record it.")
    arch: Literal["nemotron_h", "mamba2"] = Field("nemotron_h", description="Family, which decides the Hugging Face class exports are written as (NemotronHForCausalLM, Mamba2ForCausalLM).")
    vocab_size: int = Field(..., gt=0, le=MAX_VOCAB, description="Token ids the model reads and predicts (HF vocab_size, Megatron vocab_size).")
    hidden_size: int = Field(..., gt=0, le=MAX_HIDDEN, description="Model width d, in channels (HF hidden_size, Megatron hidden_size).")
    num_layers: int = Field(..., gt=0, le=MAX_LAYERS, description="Number of layers, each one symbol of the pattern (HF num_hidden_layers, Megatron num_layers).")
    pattern: str = Field(..., max_length=MAX_LAYERS, description="Layer types in order: M Mamba-2, * attention, - MLP, E MoE; e.g. M-M*-E (Megatron hybrid_override_pattern; HF NemotronH layers_block_type, hybrid_override_pattern in older configs).")
    max_seq_len: int = Field(4096, gt=0, le=MAX_SEQ_LEN, description="Longest sequence the model is meant for, in tokens (no position embeddings: Mamba layers carry order) (HF max_position_embeddings, Megatron max_position_embeddings).")
    norm_eps: float = Field(1e-5, gt=0, description="Epsilon of every RMSNorm, the Mamba gated norm included (HF layer_norm_epsilon, Megatron layernorm_epsilon).")
    mamba: MambaConfig | None = Field(None, description="The Mamba-2 mixers; needed when the pattern has M.")
    num_heads: int | None = Field(None, gt=0, le=MAX_HEADS, description="Query heads of the attention layers; needed when the pattern has * (HF num_attention_heads, Megatron num_attention_heads).")
    num_kv_heads: int | None = Field(None, gt=0, le=MAX_HEADS, description="Key/value heads (grouped-query attention); default num_heads (HF num_key_value_heads, Megatron num_query_groups).")
    head_dim: int | None = Field(None, gt=0, le=MAX_HEAD_DIM, description="Channels of one attention head; default hidden_size / num_heads (HF head_dim, Megatron kv_channels).")
    attention_dropout: float = Field(0.0, ge=0, lt=1, description="Dropout probability on attention probabilities (HF attention_dropout, Megatron attention_dropout).")
    ffn_hidden_size: int | None = Field(None, gt=0, le=MAX_FFN, description="Inner width of the MLP layers, in channels; needed when the pattern has - (HF intermediate_size, Megatron ffn_hidden_size).")
    mlp_bias: bool = Field(False, description="Biases on the MLP layers' up and down projections (HF mlp_bias; Megatron add_bias_linear, which covers every linear).")
    activation: Literal["squared_relu"] = Field("squared_relu", description="MLP and expert activation: squared ReLU, relu(x)^2 (Nemotron-H's).")
    moe: MoEConfig | None = Field(None, description="The MoE layers (the causal LM's MoE: router, experts, shared experts); needed when the pattern has E. first_k_dense and layer_freq stay at 0 and 1: the pattern places the MoE layers.")
    tie_embeddings: bool = Field(False, description="Output head shares the input embedding matrix (HF tie_word_embeddings, Megatron share_embeddings_and_output_weights).")
    residual_in_fp32: bool = Field(False, description="Keep the residual stream in float32 whatever the model dtype (HF Mamba2's residual_in_fp32).")
    init_std: float = Field(0.02, gt=0, description="Std of the normal weight init; output projections are scaled by 1/sqrt(2*num_layers) (HF initializer_range, Megatron init_method_std).")

    @model_validator(mode="before")
    @classmethod
    def _expand_preset(cls, data: Any) -> Any:
        return expand_preset(data, PRESETS, "hybrid preset")

    @model_validator(mode="after")
    def _check(self) -> HybridConfig:
        for i, symbol in enumerate(self.pattern):
            if symbol not in SYMBOLS:
                names = ", ".join(f"{k} ({v})" for k, v in SYMBOLS.items())
                raise ValueError(f"pattern: {symbol!r} (layer {i}) is not a layer symbol; use {names}")
        if len(self.pattern) != self.num_layers:
            raise ValueError(f"pattern: {len(self.pattern)} symbols for num_layers={self.num_layers}; give one "
                             "symbol per layer")
        used = set(self.pattern)
        if "M" in used and self.mamba is None:
            raise ValueError("mamba: the pattern has Mamba-2 layers (M) but no mamba section")
        if "*" in used:
            if self.num_heads is None:
                raise ValueError("num_heads: the pattern has attention layers (*) but no num_heads")
            if self.num_heads % self.kv_heads:
                raise ValueError(f"num_kv_heads ({self.kv_heads}) must divide num_heads ({self.num_heads})")
            if self.head_dim is None and self.hidden_size % self.num_heads:
                raise ValueError(f"num_heads ({self.num_heads}) must divide hidden_size ({self.hidden_size}) "
                                 "unless head_dim is given")
        if "-" in used and self.ffn_hidden_size is None:
            raise ValueError("ffn_hidden_size: the pattern has MLP layers (-) but no ffn_hidden_size")
        if "E" in used and self.moe is None:
            raise ValueError("moe: the pattern has MoE layers (E) but no moe section")
        if self.moe is not None and (self.moe.first_k_dense, self.moe.layer_freq) != (0, 1):
            raise ValueError("moe.first_k_dense / moe.layer_freq: the pattern places the MoE layers; leave them "
                             "at 0 and 1")
        return self

    @property
    def kv_heads(self) -> int | None:
        return self.num_kv_heads or self.num_heads

    @property
    def vocab_rows(self) -> int:
        """Rows of the embedding and the output head: the vocabulary (hybrid models are not padded)."""
        return self.vocab_size

    @property
    def attention_head_dim(self) -> int | None:
        if self.num_heads is None:
            return None
        return self.head_dim or self.hidden_size // self.num_heads

    def layer_config(self) -> LayerConfig:
        """The config the shared attention, MLP and MoE layers (and norms) are built from."""
        return LayerConfig(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, num_layers=self.num_layers,
            num_heads=self.num_heads or 1, num_kv_heads=self.kv_heads, head_dim=self.attention_head_dim or 1,
            ffn_hidden_size=self.ffn_hidden_size or 1, max_seq_len=self.max_seq_len, norm="rmsnorm",
            norm_eps=self.norm_eps, activation=self.activation, position="learned", bias=self.mlp_bias,
            attention_bias=[], moe=self.moe, attention_dropout=self.attention_dropout, init_std=self.init_std)

    # validate_layout's part for this kind (tessera.common.layout; what it lacks, its own modules' sizes).
    check_layout = layout_checks.check_layout
    check_tensor_parallel = layout_checks.check_tensor_parallel

    # ---- accounting ----------------------------------------------------------------------
    def num_params(self) -> int:
        """Exact parameter count of `HybridModel(self)` (tested against the real module)."""
        d = self.hidden_size
        layers = self.layer_config()
        total = self.vocab_size * d * (1 if self.tie_embeddings else 2) + d  # embedding, head, final norm
        for symbol in self.pattern:
            total += d  # the layer's norm
            if symbol == "M":
                m = self.mamba
                assert m is not None
                width = 2 * m.inner_size + 2 * m.group_width + m.num_heads
                conv = m.inner_size + 2 * m.group_width
                total += d * width + m.inner_size * d + (width + d if m.bias else 0)
                total += conv * m.conv_kernel + (conv if m.conv_bias else 0)
                total += 3 * m.num_heads + m.inner_size  # dt_bias, A_log, D, gated norm
            elif symbol == "*":
                total += 2 * d * layers.q_size + 2 * d * layers.kv_size
            elif symbol == "-":
                f = layers.ffn_hidden_size
                total += 2 * d * f + (f + d if self.mlp_bias else 0)
            else:
                moe = self.moe
                assert moe is not None
                total += d * moe.num_experts + 2 * d * (moe.num_experts * moe.ffn_hidden_size + moe.shared_size)
        return total

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward = 3 x forward), PaLM convention as the causal
        LM counts them: 6 x the matmul weights a token uses (the head; Mamba in/out projections;
        attention; MLP; MoE: router, top_k routed and the shared experts) + 12 x query width x
        seq_len per attention layer (not halved for causality) + per Mamba layer 3 x its forward:
        the depthwise convolution (2 x taps per convolved channel) and the SSD chunked scan with
        chunk Q = min(chunk_size, seq_len), as mamba_ssm computes it: in-chunk scores C.B per group
        (2 Q N, not halved, as attention's), their product with x per head (2 Q P), and the
        chunk's state contribution and the state read-out per head (2 P N each)."""
        d = self.hidden_size
        layers = self.layer_config()
        matmul = self.vocab_size * d
        extra = 0.0
        for symbol in self.pattern:
            if symbol == "M":
                m = self.mamba
                assert m is not None
                matmul += d * (2 * m.inner_size + 2 * m.group_width + m.num_heads) + m.inner_size * d
                q = min(m.chunk_size, seq_len)
                conv = 2 * m.conv_kernel * (m.inner_size + 2 * m.group_width)
                scan = 2 * q * m.group_width + m.num_heads * (2 * q * m.head_dim + 4 * m.head_dim * m.state_size)
                extra += 3 * (conv + scan)
            elif symbol == "*":
                matmul += 2 * d * layers.q_size + 2 * d * layers.kv_size
                extra += 12 * layers.q_size * seq_len
            elif symbol == "-":
                matmul += 2 * d * layers.ffn_hidden_size
            else:
                moe = self.moe
                assert moe is not None
                matmul += d * moe.num_experts + 2 * d * (moe.top_k * moe.ffn_hidden_size + moe.shared_size)
        return 6.0 * matmul + extra


# Nemotron-H-8B's pattern (NVIDIA's config.json, hybrid_override_pattern): 24 Mamba-2, 4 attention
# and 24 MLP layers.
NEMOTRON_H_8B_PATTERN = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"

PRESETS: dict[str, dict[str, Any]] = {
    # Unit tests and the CPU demo: every layer type, seconds per step on two cores; routed as
    # Nemotron-H routes (sigmoid scores, a shared expert, aux-loss-free balancing), so it exports
    # as NemotronHForCausalLM.
    "hybrid-tiny": dict(arch="nemotron_h", vocab_size=8192, hidden_size=64, num_layers=4, pattern="M*-E",
                        max_seq_len=256, mamba=dict(num_heads=4, head_dim=32, state_size=16, num_groups=2,
                                                    chunk_size=32, dt_limit_min=0.001),
                        num_heads=4, num_kv_heads=2, ffn_hidden_size=128,
                        moe=dict(num_experts=4, top_k=2, ffn_hidden_size=64, score="sigmoid", num_shared_experts=1,
                                 bias_balancing=True)),
    # Published shapes: nvidia/Nemotron-H-8B-Base-8K's config.json (Megatron-Bridge's
    # NemotronHModelProvider8B; transformers' Nemotron-H clamps the step at time_step_min, hence
    # dt_limit_min = dt_min), state-spaces/mamba2-2.7b's (d_model 2560, 64 layers, expand 2,
    # head dim 64, one group, state 128, chunk 256; vocabulary 50277 padded to a multiple of 16).
    "nemotron-h-8b": dict(arch="nemotron_h", vocab_size=131072, hidden_size=4096, num_layers=52,
                          pattern=NEMOTRON_H_8B_PATTERN, max_seq_len=8192,
                          mamba=dict(num_heads=128, head_dim=64, state_size=128, num_groups=8, conv_kernel=4,
                                     chunk_size=128, dt_limit_min=0.001),
                          num_heads=32, num_kv_heads=8, head_dim=128, ffn_hidden_size=21504),
    "mamba2-2.7b": dict(arch="mamba2", vocab_size=50288, hidden_size=2560, num_layers=64, pattern="M" * 64,
                        max_seq_len=4096, mamba=dict(num_heads=80, head_dim=64, state_size=128, num_groups=1,
                                                     conv_kernel=4, chunk_size=256),
                        tie_embeddings=True, residual_in_fp32=True),
}


def preset(name: str, **overrides: Any) -> HybridConfig:
    """A hybrid config from a named preset with field overrides."""
    return HybridConfig.model_validate({"preset": name, **overrides})
