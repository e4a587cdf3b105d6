"""Layers shared by model kinds, each written once: `norms` (RMSNorm / LayerNorm, fused residual
add), `self_attention` (projections, q/k norms, rotary, the attention core), `attention` (causal
attention over packed documents and sliding windows), `mlp` (SwiGLU / GELU), `moe` (router and
experts), `rope` (rotary embeddings and their scalings). The tensor-parallel layers live in
tessera.common.parallel."""
