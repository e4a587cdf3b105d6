"""The hybrid state-space model: Megatron's HybridModel (MambaStack), transformers' Nemotron-H and
Mamba2, from one config.

Read top to bottom: block, model. Each layer is one symbol of the config's pattern: an RMSNorm,
then a Mamba-2 mixer (M, `mamba.py`), self-attention (*), an MLP (-) or a mixture of experts (E),
then the residual add. Attention, MLP and MoE are the causal LM's layers (tessera.common.layers),
built from `HybridConfig.layer_config()`; attention has no position embeddings (the Mamba layers
carry order, as in Nemotron-H and Megatron's default). This file is the single-device model.

Parameter names are the checkpoint contract: `embed_tokens.weight`, `layers.<i>.norm.weight`,
`layers.<i>.mixer.*` (the layer's mixer, names as its module gives them), `final_norm.weight`,
`lm_head.weight`; layers live in a ModuleDict keyed by global layer number.

Packed documents: `document_ids` [B, T] (the causal LM's input: non-decreasing along T) keep
every document to itself: attention attends within it and the Mamba layers restart their
convolution and scan at each new document (mamba_ssm's seq_idx).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from tessera.common.layers.attention import MaskedAttention
from tessera.common.layers.mlp import MLP
from tessera.common.layers.moe import MoE
from tessera.common.layers.norms import RMSNorm
from tessera.common.layers.self_attention import Attention
from tessera.common.models.build import build_on_meta
from tessera.common.models.hybrid.config import HybridConfig, LayerConfig
from tessera.common.models.hybrid.mamba import CausalConv1d, GatedRMSNorm, MambaMixer
from tessera.common.parallel.context_parallel import ContextParallel, ContextParallelAttention, SequenceChunks

__all__ = ["HybridBlock", "HybridModel", "build_model", "model_tensor_shapes"]

# Linear layers writing into the residual stream: initialised with std / sqrt(2 * layers).
_OUTPUT_PROJECTIONS = ("out_proj", "o_proj", "down_proj")


class HybridBlock(nn.Module):
    def __init__(self, cfg: HybridConfig, layers: LayerConfig, layer_idx: int):
        super().__init__()
        self.symbol = cfg.pattern[layer_idx]
        self.residual_in_fp32 = cfg.residual_in_fp32
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.mixer: nn.Module
        if self.symbol == "M":
            assert cfg.mamba is not None
            self.mixer = MambaMixer(cfg.mamba, cfg.hidden_size, cfg.norm_eps)
        elif self.symbol == "*":
            self.mixer = Attention(layers, layer_idx)
        elif self.symbol == "-":
            self.mixer = MLP(layers)
        else:
            self.mixer = MoE(layers)

    def forward(self, x: torch.Tensor, document_ids: torch.Tensor | None = None,
                attn_mask: MaskedAttention | None = None, chunks: SequenceChunks | None = None) -> torch.Tensor:
        """`chunks`: context parallel (x holds this rank's chunks of the sequence)."""
        # The residual may be fp32 (residual_in_fp32) in a lower-precision model: the mixer reads
        # the norm's dtype.
        h = self.norm(x.to(self.norm.weight.dtype))
        if self.symbol == "M":
            out = self.mixer(h, document_ids) if chunks is None else self.mixer.forward_chunks(h, chunks)
        elif self.symbol == "*":
            out = self.mixer(h, None, None if chunks is None else chunks.attention, attn_mask)
        else:
            out = self.mixer(h)
        return (x.float() if self.residual_in_fp32 else x) + out


class HybridModel(nn.Module):
    """Embedding -> the pattern's layers -> final RMSNorm -> output head."""

    def __init__(self, cfg: HybridConfig):
        super().__init__()
        self.cfg = cfg
        layers = cfg.layer_config()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleDict({str(i): HybridBlock(cfg, layers, i) for i in range(cfg.num_layers)})
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """Initialise every parameter in place, visiting modules in name order (so a seed gives the
        same weights on any device): Normal(0, init_std) for embeddings and linear weights, scaled
        by 1/sqrt(2 L) for those writing into the residual stream; zero biases; unit norms;
        Megatron's initialisation for the Mamba mixers' own parameters and convolutions."""
        for name, module in sorted(self.named_modules(), key=lambda kv: kv[0]):
            self.init_module(name, module, generator)

    @torch.no_grad()
    def init_module(self, name: str, module: nn.Module, generator: torch.Generator | None = None) -> None:
        """Initialise one module's own parameters, `name` being its name in the whole model: the
        step `init_weights` takes per module, which sharded initialisation replays one global
        module at a time (tessera.trainer.parallel.sharded_init)."""
        std = self.cfg.init_std
        out_std = std / math.sqrt(2 * self.cfg.num_layers)
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, 0.0, out_std if name.endswith(_OUTPUT_PROJECTIONS) else std,
                            generator=generator)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, 0.0, std, generator=generator)
        elif isinstance(module, (RMSNorm, GatedRMSNorm)):
            module.reset_parameters()
        elif isinstance(module, CausalConv1d):
            module.reset_parameters(generator)
        elif isinstance(module, MambaMixer):
            module.reset_ssm_parameters(generator)
        elif isinstance(module, MoE):
            module.init_weights(std, out_std, generator)

    def logits(self, hidden: torch.Tensor, weight: torch.Tensor | None = None, vocab_start: int = 0) -> torch.Tensor:
        """The output head: hidden @ weight.T (`weight` a tensor-parallel vocab slice starting at row
        `vocab_start`: there is no vocabulary padding to mask)."""
        return F.linear(hidden, self.output_weight() if weight is None else weight)

    def output_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(self, tokens: torch.Tensor, document_ids: torch.Tensor | None = None,
                return_hidden: bool = False,
                context: tuple[ContextParallel, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """tokens [B, T] -> logits [B, T, V] (the final-normed hidden states with `return_hidden`).
        `document_ids` [B, T], non-decreasing along T: packed documents do not see each other.
        `context`: context parallel (tokens and document ids are this rank's chunks): the group,
        the local tokens' global indices and the gathered ones' (tessera.common.parallel.context_parallel)."""
        # A pipeline stage lacks the modules of other stages: without the embedding it takes hidden
        # states, without the final norm it returns them.
        h = self.embed_tokens(tokens) if self.embed_tokens is not None else tokens
        attn_mask, chunks = None, None
        if context is not None:
            cp, query_index, key_index = context
            chunks = SequenceChunks(cp, ContextParallelAttention(cp, self, query_index, key_index, document_ids),
                                    key_index)
        elif document_ids is not None and "*" in self.cfg.pattern:
            # Under sequence parallel h is this rank's chunk; attention sees the gathered sequence.
            attn_mask = MaskedAttention(document_ids, None, h.shape[0], document_ids.shape[1], h.device)
        for block in self.layers.values():
            h = block(h, document_ids, attn_mask, chunks)
        if self.final_norm is None:
            return h
        h = self.final_norm(h.to(self.final_norm.weight.dtype))
        return h if return_hidden else self.logits(h)


def build_model(cfg: HybridConfig, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                seed: int | None = 0) -> HybridModel:
    """Built on the meta device, materialised on `device`, initialised in place from `seed`
    (None: left for a checkpoint): tessera.common.models.build.build_on_meta."""
    return build_on_meta(lambda: HybridModel(cfg), device, dtype, seed)


def model_tensor_shapes(cfg: HybridConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor of `HybridModel(cfg).state_dict()`, in its order: what a
    checkpoint stores under `model.`. Built on the meta device from one block per layer symbol,
    so it costs about the same for 2 layers as for thousands."""
    def shapes(module: nn.Module) -> dict[str, tuple[int, ...]]:
        return {k: tuple(v.shape) for k, v in module.state_dict().items()}

    out: dict[str, tuple[int, ...]] = {}
    blocks: dict[str, dict[str, tuple[int, ...]]] = {}
    layers = cfg.layer_config()
    with torch.device("meta"):
        top = HybridModel(cfg.model_copy(update={"num_layers": 1, "pattern": cfg.pattern[0]}))
        for name, child in top.named_children():
            if name != "layers":
                out.update({f"{name}.{k}": v for k, v in shapes(child).items()})
                continue
            for i, symbol in enumerate(cfg.pattern):
                if symbol not in blocks:
                    blocks[symbol] = shapes(HybridBlock(cfg, layers, i))
                out.update({f"layers.{i}.{k}": v for k, v in blocks[symbol].items()})
    return out
