"""What the planner counts differently for a hybrid model (tessera.common.models.hybrid): its
layers follow a pattern of Mamba-2 mixers (M), attention (*), MLP (-) and MoE (E) layers, each
behind one RMSNorm. The rest of the count (bytes per parameter, optimizer, FSDP, pipeline,
the head and loss) is the decoder's (memory.py), which asks these functions for the layers.

Parameters: a Mamba mixer is split over tensor ranks as Megatron splits it (whole heads and
groups per rank: the input projections by output rows, the convolutions, dt bias, A, D and the
gated norm by channels or heads, the output projection by input columns, its bias whole);
attention, MLP and MoE layers are the causal LM's and split by its plan's names.

Activations: measured like the decoder's block (activations.measure_hybrid_block), on one
`HybridBlock` at this rank's local shapes (`local_layer`) under FakeTensorMode, so the figure follows the Mamba reference's real
saved tensors: the projections and the convolution's inputs, the chunked scan's per-chunk states
[b, chunks, heads, head_dim, state] and in-chunk decay matrices [b, heads, chunks, Q, Q], and
the gated norm's inputs. With packed documents the Mamba block is measured with document ids
(the convolution's and the scan's masks); an MoE layer as an MLP of the width a token passes
through, plus the dispatch, as the decoder's.
"""

from __future__ import annotations

import functools

import torch

from tessera.common.models.hybrid.config import HybridConfig


def is_hybrid(cfg) -> bool:
    return getattr(cfg, "kind", None) == "hybrid"


def attention_layers(cfg) -> int:
    """Layers with attention: every layer of a decoder, the `*` layers of a hybrid model."""
    return cfg.pattern.count("*") if is_hybrid(cfg) else cfg.num_layers


def attention_sizes(cfg) -> tuple[int, int]:
    """(query width, key/value width) of one attention layer; (0, 0) for a model without any."""
    if not is_hybrid(cfg):
        return cfg.q_size, cfg.kv_size
    if "*" not in cfg.pattern:
        return 0, 0
    layers = cfg.layer_config()
    return layers.q_size, layers.kv_size


@functools.lru_cache(maxsize=256)
def hybrid_layer_params(cfg_json: str, layer: int, tp: int, ep: int) -> tuple[int, int]:
    """Parameters of global layer `layer` held by one tensor x expert rank: (all, routed experts')."""
    from tessera.common.models.hybrid.model import HybridBlock
    from tessera.common.models.registry import KINDS

    cfg = HybridConfig.model_validate_json(cfg_json)
    with torch.device("meta"):
        block = HybridBlock(cfg, cfg.layer_config(), layer)
    plan = KINDS["causal_lm"].parallel()  # the attention, MLP and MoE layers are the causal LM's
    total = experts = 0
    for name, p in block.named_parameters():
        parts = name.split(".")
        if parts[0] == "norm":  # the layer's pre-norm: replicated
            total += p.numel()
        elif block.symbol == "M":
            total += p.numel() if parts[-2:] == ["out_proj", "bias"] else p.numel() // tp
        elif "experts" in parts:  # stacked routed experts: split by expert parallel
            total += p.numel() // ep
            experts += p.numel() // ep
        elif "shared" in parts or "router" in parts:
            total += p.numel()
        elif parts[-2] in plan.column:
            total += p.numel() // tp
        elif parts[-2] in plan.row:
            total += p.numel() // tp if parts[-1] == "weight" else p.numel()
        else:
            total += p.numel()
    return total, experts


def local_layer(cfg: HybridConfig, layer: int, tp: int, ep: int) -> HybridConfig:
    """A one-layer config of global layer `layer` at one tensor x expert rank's shapes."""
    update: dict = dict(num_layers=1, pattern=cfg.pattern[layer])
    if cfg.mamba is not None:
        update["mamba"] = cfg.mamba.model_copy(update=dict(num_heads=max(1, cfg.mamba.num_heads // tp),
                                                           num_groups=max(1, cfg.mamba.num_groups // tp)))
    if cfg.num_heads is not None:
        update.update(num_heads=max(1, cfg.num_heads // tp), num_kv_heads=max(1, cfg.kv_heads // tp),
                      head_dim=cfg.attention_head_dim)
    if cfg.ffn_hidden_size is not None:
        update["ffn_hidden_size"] = max(1, cfg.ffn_hidden_size // tp)
    if cfg.moe is not None and ep > 1:
        update["moe"] = cfg.moe.model_copy(update=dict(num_experts=cfg.moe.num_experts // ep,
                                                       top_k=min(cfg.moe.top_k, cfg.moe.num_experts // ep)))
    return cfg.model_copy(update=update)
