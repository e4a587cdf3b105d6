"""The vision-language kind's config: LLaVA (transformers' `LlavaForConditionalGeneration`): a ViT
vision tower (CLIP or SigLIP), the projector (linear, GELU, linear) and any causal LM.

The vision tower's attention, MLP and norms are the shared layers (tessera.common.layers), which
read a causal-LM config: `VisionConfig.layer_config` is that view (bidirectional attention, biases,
LayerNorm, no rotary embedding). Image features replace the embeddings of the `image_token_id`
tokens, one token per selected patch feature, in order.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from tessera.common.config import StrictModel
from tessera.common.models.causal_lm.config import (
    MAX_FFN,
    MAX_HEADS,
    MAX_HIDDEN,
    MAX_LAYERS,
    MAX_VOCAB,
    ModelConfig,
)
from tessera.common.models.vision_language import layout_checks

MAX_IMAGE_SIZE = 4096  # pixels per side a vision tower is built for; far above any published ViT's
MAX_CHANNELS = 16


class VisionLayerConfig(ModelConfig):
    """The shared layers' view of a ViT: the causal LM's fields, with CLIP's quick GELU allowed."""

    activation: Literal["gelu", "gelu_erf", "quick_gelu"] = Field("quick_gelu", description="See VisionConfig.activation.")  # type: ignore[assignment]


class VisionConfig(StrictModel):
    """A ViT vision tower: CLIP's (class token, pre-LayerNorm) or SigLIP's (neither; a pooling head)."""

    arch: Literal["clip", "siglip"] = Field("clip", description="clip: class embedding + pre-LayerNorm, patch conv without bias (CLIPVisionModel); siglip: no class token, no pre-LayerNorm, patch conv with bias, attention-pooling head (SiglipVisionModel).")
    hidden_size: int = Field(..., gt=0, le=MAX_HIDDEN, description="Width of the tower, in channels (HF vision_config.hidden_size; Megatron's vision TransformerConfig hidden_size).")
    num_layers: int = Field(..., gt=0, le=MAX_LAYERS, description="Transformer blocks, pre-LayerNorm and bidirectional (HF vision_config.num_hidden_layers, Megatron num_layers).")
    num_heads: int = Field(..., gt=0, le=MAX_HEADS, description="Attention heads of the tower; divides hidden_size (HF vision_config.num_attention_heads, Megatron num_attention_heads).")
    ffn_hidden_size: int = Field(..., gt=0, le=MAX_FFN, description="Inner width of the tower's MLP, in channels (HF vision_config.intermediate_size, Megatron ffn_hidden_size).")
    image_size: int = Field(..., gt=0, le=MAX_IMAGE_SIZE, description="Side of the square images the tower reads, in pixels (its position table's grid) (HF vision_config.image_size, Megatron img_h = img_w).")
    patch_size: int = Field(..., gt=0, le=MAX_IMAGE_SIZE, description="Side of one square patch, in pixels; divides image_size (HF vision_config.patch_size, Megatron patch_dim).")
    num_channels: int = Field(3, gt=0, le=MAX_CHANNELS, description="Channels of the input pixels (3: RGB) (HF vision_config.num_channels).")
    activation: Literal["quick_gelu", "gelu", "gelu_erf"] = Field("quick_gelu", description="MLP activation: quick_gelu = x*sigmoid(1.702x) (CLIP's); gelu = tanh approximation (SigLIP's gelu_pytorch_tanh); gelu_erf = exact GELU (HF 'gelu').")
    norm_eps: float = Field(1e-5, gt=0, description="Epsilon of every LayerNorm of the tower (HF vision_config.layer_norm_eps, Megatron layernorm_epsilon).")
    head: bool = Field(False, description="SigLIP only: the attention-pooling head (probe, multi-head attention, LayerNorm, MLP) of SiglipVisionModel (HF vision_use_head). It pools one vector per image; LLaVA's features do not use it, but its checkpoints carry it.")
    attention_dropout: float = Field(0.0, ge=0, lt=1, description="Dropout probability on the tower's attention probabilities (HF vision_config.attention_dropout).")

    @model_validator(mode="after")
    def _check(self) -> VisionConfig:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"vision.num_heads ({self.num_heads}) must divide vision.hidden_size ({self.hidden_size})")
        if self.image_size % self.patch_size:
            raise ValueError(f"vision.patch_size ({self.patch_size}) must divide vision.image_size ({self.image_size})")
        if self.arch == "clip" and self.head:
            raise ValueError("vision.head is SigLIP's pooling head: set it false for arch clip")
        return self

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def num_positions(self) -> int:
        """Rows of the position table: the patches, plus the class token (CLIP)."""
        return self.num_patches + (1 if self.arch == "clip" else 0)

    def layer_config(self) -> VisionLayerConfig:
        """The config the shared attention, MLP and LayerNorms are built from: biases everywhere,
        LayerNorm, no rotary embedding (positions are the learned table)."""
        return VisionLayerConfig(
            vocab_size=1, hidden_size=self.hidden_size, num_layers=self.num_layers, num_heads=self.num_heads,
            ffn_hidden_size=self.ffn_hidden_size, max_seq_len=self.num_positions, norm="layernorm",
            norm_eps=self.norm_eps, activation=self.activation, position="learned", bias=True,
            attention_dropout=self.attention_dropout)

    def num_params(self) -> int:
        d, f, c, p = self.hidden_size, self.ffn_hidden_size, self.num_channels, self.patch_size
        total = d * c * p * p + (d if self.arch == "siglip" else 0) + self.num_positions * d
        total += 3 * d if self.arch == "clip" else 0  # class embedding, pre-LayerNorm
        total += self.num_layers * (4 * d * d + 4 * d + 2 * d * f + f + d + 4 * d) + 2 * d  # blocks, post-LayerNorm
        if self.head:
            total += d + 4 * d * d + 4 * d + 2 * d + 2 * d * f + f + d  # probe, attention, norm, MLP
        return total


class ProjectorConfig(StrictModel):
    """LLaVA's multi-modal projector: linear (vision width -> text width), activation, linear."""

    activation: Literal["gelu_erf", "gelu", "quick_gelu"] = Field("gelu_erf", description="Between the two linears: gelu_erf = exact GELU (HF projector_hidden_act 'gelu', LLaVA's); gelu = tanh approximation; quick_gelu.")
    bias: bool = Field(True, description="Biases on both linears (HF multimodal_projector_bias).")


class VisionLanguageConfig(StrictModel):
    """A LLaVA-style model: vision tower -> projector -> the language model's embeddings."""

    kind: Literal["vision_language"] = Field("vision_language", description="Model kind (tessera.common.models.registry).")
    arch: Literal["llava"] = Field("llava", description="Family: the Hugging Face class exports are written as (LlavaForConditionalGeneration).")
    vision: VisionConfig = Field(..., description="The vision tower (HF vision_config; Megatron's vision TransformerConfig).")
    projector: ProjectorConfig = Field(default_factory=ProjectorConfig, description="The projector from vision features to the language model's width (Megatron vision_projection_config, type mlp).")
    text: ModelConfig = Field(..., description="The language model: any causal-LM config (tessera.common.models.causal_lm), dense or MoE (HF text_config; Megatron's language TransformerConfig).")
    image_token_id: int = Field(..., ge=0, lt=MAX_VOCAB, description="Token id standing for one image feature in the text; the processor writes one per selected patch (HF image_token_id / image_token_index, Megatron image_token_index).")
    vision_feature_layer: int = Field(-2, description="Which vision hidden state the projector reads: 0 = the embeddings (after CLIP's pre-LayerNorm), i = after block i, negative counts from the end (-1 = the last block's output; HF's default -2). No post-LayerNorm either way, as transformers.")
    vision_feature_select_strategy: Literal["default", "full"] = Field("default", description="default: drop the first feature of each image (CLIP's class token; transformers drops it for SigLIP too; Megatron drop_vision_class_token); full: keep all (HF vision_feature_select_strategy).")

    @model_validator(mode="after")
    def _check(self) -> VisionLanguageConfig:
        n = self.vision.num_layers
        if not -(n + 1) <= self.vision_feature_layer <= n:
            raise ValueError(f"vision_feature_layer ({self.vision_feature_layer}) must be in -{n + 1}..{n} "
                             f"(the tower has {n} blocks)")
        if self.image_token_id >= self.text.vocab_rows:
            raise ValueError(f"image_token_id ({self.image_token_id}) must be below the language model's "
                             f"vocabulary ({self.text.vocab_rows} rows)")
        if self.text.mtp is not None:  # the VLM's losses are the answer tokens' next-token loss alone
            raise ValueError("text.mtp: multi-token prediction is not built for a vision-language model's language "
                             "model (it would not be trained); remove it")
        if self.vision_feature_select_strategy == "default" and self.vision.num_positions < 2:
            raise ValueError("vision_feature_select_strategy default drops the first feature: the tower has only one")
        return self

    # The language model's, which the stages read of every kind (tokenizer fit, sequence length).
    @property
    def vocab_size(self) -> int:
        return self.text.vocab_size

    @property
    def vocab_rows(self) -> int:
        return self.text.vocab_rows

    @property
    def max_seq_len(self) -> int:
        return self.text.max_seq_len

    @property
    def num_layers(self) -> int:
        """The language model's blocks (what a pipeline's layer split counts)."""
        return self.text.num_layers

    def refit_for(self, tensor_parallel: int) -> VisionLanguageConfig:
        """Itself when `tensor_parallel` divides the language model's vocabulary rows, else with the
        language model re-padded (ModelConfig.refit_for: an HF export served under tensor parallel)."""
        text = self.text.refit_for(tensor_parallel)
        return self if text is self.text else self.model_copy(update={"text": text})

    @property
    def feature_layer_index(self) -> int:
        """vision_feature_layer as an index into (embeddings, block 1 output, ..., block n output)."""
        n = self.vision.num_layers
        return self.vision_feature_layer % (n + 1)

    @property
    def image_seq_len(self) -> int:
        """Image tokens (features) per image."""
        return self.vision.num_positions - (1 if self.vision_feature_select_strategy == "default" else 0)

    # validate_layout's part for this kind (tessera.common.layout; what it lacks, its own modules' sizes).
    check_layout = layout_checks.check_layout

    def num_params(self) -> int:
        dv, dt = self.vision.hidden_size, self.text.hidden_size
        projector = dv * dt + dt * dt + (2 * dt if self.projector.bias else 0)
        return self.vision.num_params() + projector + self.text.num_params()

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per text token (PaLM convention, as the causal LM): the language model's,
        plus, for a sequence that is all image tokens, the tower's and projector's share per token
        (6 x matmul weights per patch + attention over the patches, spread over the image's
        `image_seq_len` tokens). A frozen tower costs less in training; this is the upper bound."""
        v = self.vision
        d, f, p = v.hidden_size, v.ffn_hidden_size, v.num_positions
        tower = 6.0 * v.num_layers * (4 * d * d + 2 * d * f) * p + 12.0 * v.num_layers * d * p * p
        tower += 6.0 * d * v.num_channels * v.patch_size ** 2 * v.num_patches
        projector = 6.0 * (d * self.text.hidden_size + self.text.hidden_size ** 2) * self.image_seq_len
        return self.text.flops_per_token(seq_len) + (tower + projector) / self.image_seq_len
