"""The model config: one typed description of every supported decoder, with named presets.

A single config covers GPT-2 (LayerNorm, learned positions, GELU, biases, tied embeddings),
Llama 2/3 (RMSNorm, RoPE with theta and scaling, SwiGLU, grouped/multi-query attention, untied
head), Mistral (sliding-window attention), Qwen2 (q/k/v biases), Qwen3 (q/k norm, explicit head
dimension) and mixtures of experts (Mixtral, Qwen3-MoE, DeepSeek-style routing; `moe`). Every
field defaults to the plain Llama behaviour. The trainer, the converter and the server all build
the model from this config, and checkpoints and exports carry it in their sidecars.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import Field, model_validator

from tessera.common.config import StrictModel, expand_preset

# Upper bounds on the sizes a config may state: far above every published model (Llama-3.1-405B:
# 126 layers, width 16384, MLP 53248, 128 heads; vocabularies up to ~262k; contexts up to ~10M
# tokens; MoE up to a few hundred experts). A config read from an artifact (a sidecar, a
# config.json) is refused past them before anything is sized from it, so a hostile file cannot
# make a reader allocate terabytes or build millions of layers (docs/security.md).
MAX_LAYERS = 4096
MAX_HIDDEN = 2**17
MAX_FFN = 2**20
MAX_HEADS = 2**12
MAX_HEAD_DIM = 2**12
MAX_VOCAB = 2**24
MAX_SEQ_LEN = 2**24
MAX_EXPERTS = 2**14
MAX_VOCAB_MULTIPLE = 2**16


class RopeScaling(StrictModel):
    """Llama-3 style frequency-dependent RoPE scaling (HF `rope_type: llama3`); the default kind
    when `rope_scaling` names none (see tessera.common.layers.rope for every kind)."""

    rope_type: Literal["llama3"] = Field("llama3", description="Llama-3.1 wavelength-dependent scaling.")
    factor: float = Field(8.0, gt=0, description="Wavelength stretch applied to low frequencies.")
    low_freq_factor: float = Field(1.0, gt=0, description="Wavelengths above original/low_freq_factor are scaled fully.")
    high_freq_factor: float = Field(4.0, gt=0, description="Wavelengths below original/high_freq_factor are kept.")
    original_max_position_embeddings: int = Field(8192, gt=0, description="Context length the base model was trained at.")


class LinearRopeScaling(StrictModel):
    """Position interpolation (HF `rope_type: linear`): every frequency divided by `factor`."""

    rope_type: Literal["linear"] = Field(..., description="Linear scaling.")
    factor: float = Field(..., gt=0, description="Divisor of every frequency.")


class DynamicRopeScaling(StrictModel):
    """Dynamic NTK (HF `rope_type: dynamic`): the base grows once a call goes past the original length."""

    rope_type: Literal["dynamic"] = Field(..., description="Dynamic NTK scaling.")
    factor: float = Field(..., gt=0, description="Scaling factor.")
    original_max_position_embeddings: int = Field(..., gt=0, description="Length up to which RoPE is unscaled (HF max_position_embeddings).")


class YarnRopeScaling(StrictModel):
    """YaRN (HF `rope_type: yarn`), as transformers computes it."""

    rope_type: Literal["yarn"] = Field(..., description="YaRN scaling.")
    factor: float = Field(..., gt=0, description="Context extension factor.")
    original_max_position_embeddings: int = Field(..., gt=0, description="Context length the base model was trained at.")
    beta_fast: float = Field(32.0, gt=0, description="Rotations above which a dimension is extrapolated.")
    beta_slow: float = Field(1.0, gt=0, description="Rotations below which a dimension is interpolated.")
    attention_factor: float | None = Field(None, gt=0, description="Scale of cos/sin; default 0.1 ln(factor) + 1.")
    mscale: float | None = Field(None, description="DeepSeek mscale (with mscale_all_dim sets the attention factor).")
    mscale_all_dim: float | None = Field(None, description="DeepSeek mscale_all_dim.")
    truncate: bool = Field(True, description="Round the correction range to whole dimensions (transformers' default).")


AnyRopeScaling = Annotated[
    Union[RopeScaling, LinearRopeScaling, DynamicRopeScaling, YarnRopeScaling], Field(discriminator="rope_type")
]


class MoEConfig(StrictModel):
    """A mixture-of-experts MLP in place of the dense one (see tessera.common.layers.moe)."""

    num_experts: int = Field(..., gt=0, le=MAX_EXPERTS, description="Routed experts per MoE layer.")
    top_k: int = Field(..., gt=0, le=MAX_EXPERTS, description="Experts each token is routed to.")
    ffn_hidden_size: int = Field(..., gt=0, le=MAX_FFN, description="Inner width of one routed expert (SwiGLU).")
    score: Literal["softmax", "sigmoid"] = Field("softmax", description="Router scoring (sigmoid: DeepSeek-V3).")
    norm_topk_prob: bool = Field(True, description="Renormalise the top-k weights to sum to 1 (Mixtral, Qwen3-MoE).")
    routed_scaling_factor: float = Field(1.0, gt=0, description="Multiplier on the routed weights (DeepSeek-V3).")
    num_shared_experts: int = Field(0, ge=0, le=MAX_EXPERTS, description="Shared experts every token goes through (DeepSeek).")
    shared_ffn_hidden_size: int | None = Field(None, gt=0, le=MAX_FFN, description="Inner width of the shared MLP; default num_shared_experts x ffn_hidden_size.")
    num_groups: int = Field(1, gt=0, description="Expert groups for grouped routing (DeepSeek n_group); 1 = off.")
    topk_groups: int = Field(1, gt=0, description="Groups a token may route into (DeepSeek topk_group).")
    aux_loss_coef: float = Field(0.0, ge=0, description="Coefficient of the Switch/Mixtral load-balancing loss added to the training loss.")
    bias_balancing: bool = Field(False, description="Auxiliary-loss-free balancing (DeepSeek-V3): a per-expert bias added to the scores for selection only, updated after each step.")
    bias_update_rate: float = Field(1e-3, ge=0, description="Step of the bias update: bias += rate * sign(mean load - load).")
    capacity_factor: float | None = Field(None, gt=0, description="Tokens per expert capped at factor x tokens x top_k / experts (overflow dropped); None = dropless.")
    first_k_dense: int = Field(0, ge=0, description="The first k layers keep a dense MLP.")
    layer_freq: int = Field(1, gt=0, description="After the first k, layer i is MoE when i % layer_freq == 0.")

    @model_validator(mode="after")
    def _check(self) -> MoEConfig:
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k ({self.top_k}) must not exceed num_experts ({self.num_experts})")
        if self.num_experts % self.num_groups:
            raise ValueError(f"num_groups ({self.num_groups}) must divide num_experts ({self.num_experts})")
        if self.topk_groups > self.num_groups:
            raise ValueError(f"topk_groups ({self.topk_groups}) must not exceed num_groups ({self.num_groups})")
        if self.topk_groups * (self.num_experts // self.num_groups) < self.top_k:
            raise ValueError(f"topk_groups ({self.topk_groups}) groups hold fewer than top_k ({self.top_k}) experts")
        return self

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense and layer % self.layer_freq == 0

    @property
    def shared_size(self) -> int:
        return self.shared_ffn_hidden_size or self.num_shared_experts * self.ffn_hidden_size


class MLAConfig(StrictModel):
    """Multi-head latent attention (DeepSeek-V2/V3; see tessera.common.layers.mla): queries through
    an optional low-rank bottleneck, keys and values from one compressed latent per token, and a
    RoPE part of each query/key head kept apart from the un-rotated part."""

    q_lora_rank: int | None = Field(None, gt=0, le=MAX_HIDDEN, description="Rank of the query bottleneck, in channels (q_a_proj, its norm, q_b_proj); None = one q_proj (HF and Megatron q_lora_rank).")
    kv_lora_rank: int = Field(..., gt=0, le=MAX_HIDDEN, description="Width of the compressed key/value latent, in channels (what a latent KV cache keeps per token) (HF and Megatron kv_lora_rank).")
    qk_nope_head_dim: int = Field(..., gt=0, le=MAX_HEAD_DIM, description="Per-head query/key channels without RoPE (HF qk_nope_head_dim, Megatron qk_head_dim).")
    qk_rope_head_dim: int = Field(..., gt=0, le=MAX_HEAD_DIM, description="Per-head query/key channels with RoPE, the key part shared by all heads (HF qk_rope_head_dim, Megatron qk_pos_emb_head_dim).")
    v_head_dim: int = Field(..., gt=0, le=MAX_HEAD_DIM, description="Per-head value channels (HF and Megatron v_head_dim).")
    latent_norm_eps: float = Field(1e-6, gt=0, description="Epsilon of the q/kv latent norms (transformers fixes it at 1e-6).")
    rope_interleave: bool = Field(True, description="Hugging Face layout of the RoPE dimensions (DeepSeek's interleaved pairs); Tessera stores rotate-half and the adapter permutes rows.")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


class MTPConfig(StrictModel):
    """Multi-token prediction (DeepSeek-V3, Megatron-Core's mtp_num_layers): `depth` chained modules,
    the k-th predicting token t+k+1 from the (k-1)-th's hidden state and the embedding of token t+k,
    sharing the model's embedding and output head (see causal_lm.model.MTPLayer)."""

    depth: int = Field(1, gt=0, le=16, description="MTP modules, each one transformer block of the model's kind predicting one token further (HF num_nextn_predict_layers, Megatron mtp_num_layers).")
    loss_scaling_factor: float = Field(0.1, ge=0, description="Weight of the MTP loss (mean over depths) added to the main loss (Megatron's mtp_loss_scaling_factor; DeepSeek-V3 used 0.3 then 0.1).")


class ModelConfig(StrictModel):
    """Shape and flavour of a decoder-only transformer."""

    kind: Literal["causal_lm"] = Field("causal_lm", description="Model kind (tessera.common.models.registry); configs and checkpoints without it are causal_lm.")
    arch: Literal["llama", "gpt2", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe", "deepseek_v3"] = Field("llama", description="Family, which decides the Hugging Face class exports are written as (see docs/model.md).")
    vocab_size: int = Field(..., gt=0, le=MAX_VOCAB, description="Token ids the model reads and predicts: the tokenizer's vocabulary (what exports show).")
    padded_vocab_size: int | None = Field(None, gt=0, le=MAX_VOCAB, description="Rows of the embedding and the output head when more than vocab_size (set by `padded_for`); the rows past vocab_size are zero-initialised and their logits are -inf. null = vocab_size rows.")
    vocab_size_divisible_by: int = Field(128, gt=0, le=MAX_VOCAB_MULTIPLE, description="Vocabulary padding rule (Megatron's --make-vocab-size-divisible-by): a new model's rows are vocab_size rounded up to a multiple of this x tensor-parallel size.")
    hidden_size: int = Field(..., gt=0, le=MAX_HIDDEN, description="Model width d.")
    num_layers: int = Field(..., gt=0, le=MAX_LAYERS, description="Number of transformer blocks.")
    num_heads: int = Field(..., gt=0, le=MAX_HEADS, description="Query heads.")
    num_kv_heads: int | None = Field(None, gt=0, le=MAX_HEADS, description="Key/value heads (grouped-query attention); defaults to num_heads.")
    ffn_hidden_size: int = Field(..., gt=0, le=MAX_FFN, description="Inner width of the MLP.")
    max_seq_len: int = Field(2048, gt=0, le=MAX_SEQ_LEN, description="Longest sequence the model handles (learned positions / RoPE cache).")
    norm: Literal["rmsnorm", "layernorm"] = Field("rmsnorm", description="Normalisation layer.")
    norm_eps: float = Field(1e-5, gt=0, description="Epsilon of the normalisation layers.")
    activation: Literal["swiglu", "gelu"] = Field("swiglu", description="MLP: SwiGLU (gate/up/down) or GELU (up/down, tanh approximation as GPT-2).")
    position: Literal["rope", "learned"] = Field("rope", description="Rotary embeddings or learned absolute positions.")
    rope_theta: float = Field(10000.0, gt=0, description="RoPE base frequency.")
    rope_scaling: AnyRopeScaling | None = Field(None, description="Optional RoPE scaling: llama3 (the default kind), linear, dynamic or yarn.")
    bias: bool = Field(False, description="Biases on the attention and MLP linear layers (GPT-2: true).")
    attention_bias: list[Literal["q", "k", "v", "o"]] | None = Field(None, description="Attention projections with a bias (Qwen2: [q, k, v]); None = all four when `bias`, else none.")
    qk_norm: bool = Field(False, description="RMSNorm over each query and key head before RoPE (Qwen3).")
    head_dim: int = Field(None, gt=0, le=MAX_HEAD_DIM, description="Width of one attention head; default hidden_size / num_heads (Qwen3 sets it).")  # type: ignore[assignment]
    sliding_window: int | None = Field(None, gt=0, description="Each query sees only the last `sliding_window` positions, itself included (Mistral).")
    sliding_window_layers: list[int] | None = Field(None, description="Global layer numbers that use the sliding window; None = every layer (Gemma-style interleaving lists some).")
    moe: MoEConfig | None = Field(None, description="Mixture-of-experts MLP on the layers it selects; None = dense everywhere.")
    mla: MLAConfig | None = Field(None, description="Multi-head latent attention (DeepSeek-V3) in place of q/k/v/o; head_dim is then its qk_rope_head_dim (the RoPE tables' width).")
    mtp: MTPConfig | None = Field(None, description="Multi-token prediction modules trained beside the main head (DeepSeek-V3); None = none.")
    tie_embeddings: bool = Field(False, description="Output head shares the input embedding matrix.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on embeddings and residual branches.")
    attention_dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on attention probabilities.")
    init_std: float = Field(0.02, gt=0, description="Std of the normal weight init; output projections are scaled by 1/sqrt(2*num_layers).")

    @model_validator(mode="before")
    @classmethod
    def _expand_preset(cls, data: Any) -> Any:
        data = expand_preset(data, PRESETS)
        if isinstance(data, dict):
            data = dict(data)
            scaling = data.get("rope_scaling")
            if isinstance(scaling, dict) and "rope_type" not in scaling:
                data["rope_scaling"] = {"rope_type": "llama3", **scaling}  # the one kind before others existed
            hidden, heads = data.get("hidden_size"), data.get("num_heads")
            mla = data.get("mla")
            if data.get("head_dim") is None and isinstance(mla, dict) and isinstance(mla.get("qk_rope_head_dim"), int):
                data["head_dim"] = mla["qk_rope_head_dim"]
            if data.get("head_dim") is None and isinstance(hidden, int) and isinstance(heads, int) and heads > 0:
                if hidden % heads:
                    raise ValueError(f"num_heads ({heads}) must divide hidden_size ({hidden}) unless head_dim is given")
                data["head_dim"] = hidden // heads
        return data

    @model_validator(mode="after")
    def _check_shapes(self) -> ModelConfig:
        if self.num_heads % self.kv_heads:
            raise ValueError(f"num_kv_heads ({self.kv_heads}) must divide num_heads ({self.num_heads})")
        if self.padded_vocab_size is not None and self.padded_vocab_size < self.vocab_size:
            raise ValueError(f"padded_vocab_size ({self.padded_vocab_size}) is below vocab_size ({self.vocab_size})")
        if self.position == "rope" and self.head_dim % 2:
            raise ValueError(f"RoPE needs an even head dimension, got {self.head_dim}")
        if self.sliding_window_layers is not None and self.sliding_window is None:
            raise ValueError("sliding_window_layers needs sliding_window")
        bad = [i for i in self.sliding_window_layers or [] if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"sliding_window_layers: layer {bad[0]} is not in 0..{self.num_layers - 1}")
        if self.attention_bias is not None and len(set(self.attention_bias)) != len(self.attention_bias):
            raise ValueError("attention_bias lists a projection twice")
        if self.mla is not None:
            if self.head_dim != self.mla.qk_rope_head_dim:
                raise ValueError(f"mla: head_dim ({self.head_dim}) must equal qk_rope_head_dim ({self.mla.qk_rope_head_dim})")
            if self.kv_heads != self.num_heads or self.position != "rope" or self.sliding_window or self.qk_norm:
                raise ValueError("mla needs num_kv_heads = num_heads, position=rope, no sliding window, no qk_norm")
            if self.bias or self.attention_bias:
                raise ValueError("mla has no attention biases (bias and attention_bias must be unset)")
        if self.mtp is not None and (self.arch != "deepseek_v3" or self.sliding_window or self.position != "rope"):
            raise ValueError("mtp is built for arch=deepseek_v3 (rotary positions, no sliding window), whose "
                             "checkpoints hold its modules")
        if self.moe is not None and self.activation == "gelu":
            raise ValueError("moe needs activation=swiglu (experts are SwiGLU MLPs)")
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

    def attn_bias(self, proj: str) -> bool:
        """Whether attention projection `proj` (q, k, v or o) has a bias."""
        return self.bias if self.attention_bias is None else proj in self.attention_bias

    def window(self, layer: int) -> int | None:
        """The sliding window of global layer `layer`, or None for full causal attention."""
        if self.sliding_window is None or (self.sliding_window_layers is not None and layer not in self.sliding_window_layers):
            return None
        return self.sliding_window

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe is not None and self.moe.is_moe_layer(layer)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.kv_heads * self.head_dim

    # ---- accounting ----------------------------------------------------------------------
    def _mlp_params(self, layer: int, active: bool) -> int:
        """MLP weights of one layer (all experts, or those one token uses when `active`)."""
        d, f = self.hidden_size, self.ffn_hidden_size
        if not self.is_moe_layer(layer):
            return (3 if self.activation == "swiglu" else 2) * d * f
        moe = self.moe
        assert moe is not None
        experts = moe.top_k if active else moe.num_experts
        return d * moe.num_experts + 3 * d * (experts * moe.ffn_hidden_size + moe.shared_size)

    def _attn_params(self) -> int:
        d, m = self.hidden_size, self.mla
        if m is None:
            return d * self.q_size + 2 * d * self.kv_size + self.q_size * d
        h = self.num_heads
        q = d * h * m.qk_head_dim if m.q_lora_rank is None else m.q_lora_rank * (d + 1 + h * m.qk_head_dim)
        kv = d * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank * (1 + h * (m.qk_nope_head_dim + m.v_head_dim))
        return q + kv + h * m.v_head_dim * d

    def num_params(self, include_embedding: bool = True) -> int:
        """Exact parameter count of `Transformer(self)` (tested against the real module)."""
        d, f, v = self.hidden_size, self.ffn_hidden_size, self.vocab_rows
        norm_params = d * (2 if self.norm == "layernorm" else 1)
        attn = self._attn_params()
        attn += sum(n for p, n in (("q", self.q_size), ("k", self.kv_size), ("v", self.kv_size), ("o", d))
                    if self.attn_bias(p))
        if self.qk_norm:
            attn += 2 * self.head_dim
        total = norm_params
        for layer in range(self.num_layers):
            mlp = self._mlp_params(layer, active=False)
            if self.bias and not self.is_moe_layer(layer):
                mlp += (2 * f if self.activation == "swiglu" else f) + d
            total += attn + mlp + 2 * norm_params
        if include_embedding:
            total += v * d
            if self.position == "learned":
                total += self.max_seq_len * d
        if not self.tie_embeddings:
            total += v * d
        if self.mtp is not None:  # per depth: enorm, hnorm, eh_proj, one block, head norm
            for k in range(self.mtp.depth):
                layer = self.num_layers + k
                mlp = self._mlp_params(layer, active=False)
                if self.bias and not self.is_moe_layer(layer):
                    mlp += (2 * f if self.activation == "swiglu" else f) + d
                total += 5 * norm_params + 2 * d * d + attn + mlp
        return total

    def matmul_params(self) -> int:
        """Weights that take part in matrix multiplies: projections, MLP and the output head.

        Excludes embedding lookups, norms and biases; the head counts even when tied. For MoE
        layers, only what one token uses: the router, top_k routed experts and the shared ones.
        Each MTP depth adds its eh_proj, its block and another pass through the head.
        """
        d, m = self.hidden_size, self.mla
        attn = self._attn_params()
        if m is not None:  # the latent norms
            attn -= m.kv_lora_rank + (m.q_lora_rank or 0)
        total = sum(attn + self._mlp_params(i, active=True) for i in range(self.num_layers)) + self.vocab_rows * d
        for k in range(self.mtp.depth if self.mtp is not None else 0):
            total += 2 * d * d + attn + self._mlp_params(self.num_layers + k, active=True) + self.vocab_rows * d
        return total

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward), PaLM convention.

        6 x matmul_params() + 12 x layers x query width x seq_len for the attention scores and
        weighted sum (not halved for causal masking, as is customary).
        """
        blocks = self.num_layers + (self.mtp.depth if self.mtp is not None else 0)
        return 6.0 * self.matmul_params() + 12.0 * blocks * self.q_size * seq_len


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
    # Mixtures of experts for CPU tests and the MoE demo.
    "mixtral-tiny": dict(arch="mixtral", vocab_size=8192, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                         ffn_hidden_size=96, max_seq_len=256, rope_theta=1000000.0,
                         moe=dict(num_experts=4, top_k=2, ffn_hidden_size=96, aux_loss_coef=0.01)),
    "qwen3-moe-tiny": dict(arch="qwen3_moe", vocab_size=8192, hidden_size=64, num_layers=3, num_heads=4,
                           num_kv_heads=2, head_dim=32, qk_norm=True, ffn_hidden_size=192, max_seq_len=256,
                           norm_eps=1e-6, rope_theta=1000000.0,
                           moe=dict(num_experts=8, top_k=2, ffn_hidden_size=48, first_k_dense=1, aux_loss_coef=0.001)),
    # Published shapes (Qwen3-8B, Mixtral-8x7B, Qwen3-30B-A3B config.json).
    "qwen3-8b": dict(arch="qwen3", vocab_size=151936, hidden_size=4096, num_layers=36, num_heads=32, num_kv_heads=8,
                     head_dim=128, qk_norm=True, ffn_hidden_size=12288, max_seq_len=40960, norm_eps=1e-6,
                     rope_theta=1000000.0),
    "mixtral-8x7b": dict(arch="mixtral", vocab_size=32000, hidden_size=4096, num_layers=32, num_heads=32,
                         num_kv_heads=8, ffn_hidden_size=14336, max_seq_len=32768, rope_theta=1000000.0,
                         moe=dict(num_experts=8, top_k=2, ffn_hidden_size=14336, aux_loss_coef=0.02)),
    "qwen3-30b-a3b": dict(arch="qwen3_moe", vocab_size=151936, hidden_size=2048, num_layers=48, num_heads=32,
                          num_kv_heads=4, head_dim=128, qk_norm=True, ffn_hidden_size=6144, max_seq_len=40960,
                          norm_eps=1e-6, rope_theta=1000000.0,
                          moe=dict(num_experts=128, top_k=8, ffn_hidden_size=768, aux_loss_coef=0.001)),
    "llama3-8b": dict(arch="llama", vocab_size=128256, hidden_size=4096, num_layers=32, num_heads=32,
                      num_kv_heads=8, ffn_hidden_size=14336, max_seq_len=8192, rope_theta=500000.0),
}


def preset(name: str, **overrides: Any) -> ModelConfig:
    """Build a config from a named preset with field overrides (e.g. vocab_size from the tokenizer)."""
    return ModelConfig.model_validate({"preset": name, **overrides})
