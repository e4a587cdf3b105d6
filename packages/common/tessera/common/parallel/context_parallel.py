"""Context parallel: the sequence split over a group of ranks, attention by all-gather of K/V.

The sequence of T tokens is cut into 2C equal chunks; context rank i holds chunks i and 2C-1-i
(load balance under the causal mask: an early chunk attends to few keys, a late one to many, so
every rank gets the same amount of attention work). Everything outside attention is per token
and runs on the local 2T/(2C) = T/C tokens unchanged: embeddings, norms, MLPs, the head, the loss.
Inside attention each rank all-gathers the keys and values of the whole sequence (autograd:
backward reduce-scatters their gradients, so a key's gradient sums the contributions of every
rank's queries) and attends its local queries to them, causal by the *global token indices* of
both sides (key index <= query index), within a sliding window when the layer has one. One
sequence: on CUDA the keys are put back in global order and FlexAttention attends the local
queries by their global indices under a block mask (O(T/C x T / 128^2) flags, fully masked blocks
skipped, the fused kernel kept); on CPU (no FlexAttention backward in torch 2.13) under an additive
[T/C, T] mask, which `tessera-plan` counts. Packed documents: the keys and the document ids
(gathered once per forward) are put back in global order and `tessera.common.layers.attention.
MaskedAttention` attends the local queries by their global indices, with no [T/C, T] mask
(FlexAttention on CUDA; on CPU fused SDPA over the documents holding local queries, the other
queries of those documents zero and discarded: up to C times the attention work of the local
queries alone, exact all the same). This is exact: every query sees the same keys with the same
mask as in one process, only the key order inside the softmax differs (float reassociation).
Megatron offers the same all-gather variant ("a2a"/"allgather" CP) beside ring attention;
all-gather is simpler, exact, and costs one [B, T, kv_heads, head_dim] K and V per layer in
memory (ring attention would avoid that).

Positions travel with the chunks: a rank's rotary/learned positions are the global positions of
its tokens (or, for packed documents, the per-document positions of those tokens), so rotary
embeddings are applied before the gather and need no further care.

Parameters are replicated over the context group; each rank's gradient covers only its tokens,
so gradients are summed over the group (the trainer's GradientBuckets) with each rank's loss
scaled by 1/C (its share of the tokens).

Mamba layers (hybrid models) cannot take their scan in pieces: their convolution and scan run along
the whole sequence. As Megatron-Core's Mamba context parallel does, a layer trades the sequence
split for a head split (`context_to_heads`, one all-to-all per projected part): each rank then
holds the whole sequence, in global order, of 1/C of the heads and of the B/C groups (a group's
heads are consecutive, so they stay together), runs the convolution and the scan on them as one
process would, and trades back (`heads_to_context`) before the gated norm and the output
projection, which read all heads of the rank's own tokens. Exact as well: each head sees the same
sequence as in one process.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tessera.common.layers.attention import MaskedAttention
from tessera.common.parallel.mappings import all_to_all_rows, gather_seq


def local_token_index(seq_len: int, cp: int, cp_rank: int) -> torch.Tensor:
    """Global token indices [seq_len / cp] held by `cp_rank`: chunk cp_rank, then chunk 2C-1-cp_rank."""
    if seq_len % (2 * cp):
        raise ValueError(f"seq_len {seq_len} is not divisible into 2 x {cp} chunks")
    n = seq_len // (2 * cp)
    first = torch.arange(cp_rank * n, (cp_rank + 1) * n)
    last = torch.arange((2 * cp - 1 - cp_rank) * n, (2 * cp - cp_rank) * n)
    return torch.cat([first, last])


@dataclass
class ContextParallel:
    """This rank's place in the context-parallel group; slices full-sequence tensors to its chunks."""

    group: dist.ProcessGroup | None
    size: int
    rank: int

    @property
    def enabled(self) -> bool:
        return self.size > 1

    def local_index(self, seq_len: int, device: torch.device | None = None) -> torch.Tensor:
        return local_token_index(seq_len, self.size, self.rank).to(device)

    def key_index(self, seq_len: int, device: torch.device | None = None) -> torch.Tensor:
        """Global token indices of the all-gathered keys, in gather (rank) order: [seq_len]."""
        return torch.cat([local_token_index(seq_len, self.size, r) for r in range(self.size)]).to(device)

    def split(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's chunks of a full-sequence tensor (sequence along `dim`)."""
        if not self.enabled:
            return x
        return x.index_select(dim, self.local_index(x.shape[dim], x.device)).contiguous()

    def gather_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """All-gather a local [B, T/C] integer tensor (document ids) in rank order, no autograd."""
        parts = [torch.empty_like(ids) for _ in range(self.size)]
        dist.all_gather(parts, ids.contiguous(), group=self.group)
        return torch.cat(parts, dim=1)


def use_flex(q: torch.Tensor, dropout_p: float) -> bool:
    """One sequence per sample goes through FlexAttention where it runs fused (CUDA, no dropout)."""
    return q.device.type == "cuda" and dropout_p == 0.0


class ContextParallelAttention:
    """An `attention_fn` for `Transformer.forward`: local queries against all-gathered keys/values.

    Built once per forward (the masks are shared by every layer with the same sliding window).
    `query_index` [Tl] and `key_index` [T] are global token indices; `document_ids` [B, Tl] the
    local queries' documents (None: one document per sample)."""

    def __init__(self, cp: ContextParallel, model, query_index: torch.Tensor, key_index: torch.Tensor,
                 document_ids: torch.Tensor | None = None):
        self.cp = cp
        self.query_index, self.key_index = query_index, key_index
        # The causal LM's blocks hold `attn`; a hybrid model's attention blocks hold it as `mixer`.
        self.attn = {int(name): block.attn if hasattr(block, "attn") else block.mixer
                     for name, block in model.layers.items()}
        self._masks: dict[tuple[int | None, torch.dtype], torch.Tensor] = {}
        self.documents: dict[int | None, MaskedAttention] = {}
        self.key_docs: torch.Tensor | None = None
        self.global_order = torch.argsort(key_index)  # gathered (rank) order -> global order
        if document_ids is not None:
            self.key_docs = cp.gather_ids(document_ids).index_select(1, self.global_order)  # [B, T]

    def mask(self, window: int | None, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Additive [1, 1, Tl, T] mask (one document per sample): causal by global index, within the window."""
        key = (window, dtype)
        if key not in self._masks:
            q, k = self.query_index[:, None], self.key_index[None, :]
            allowed = k <= q
            if window is not None:
                allowed = allowed & (k > q - window)
            mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
            self._masks[key] = mask.masked_fill_(~allowed, float("-inf"))[None, None]
        return self._masks[key]

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        attn = self.attn[layer_idx]
        k, v = gather_seq(k, self.cp.group), gather_seq(v, self.cp.group)  # [B, T, Hkv, D]
        dropout_p = attn.dropout if attn.training else 0.0
        if self.key_docs is not None or use_flex(q, dropout_p):  # keys in global order, no [Tl, T] mask
            k, v = k.index_select(1, self.global_order), v.index_select(1, self.global_order)
            if attn.window not in self.documents:
                self.documents[attn.window] = MaskedAttention(
                    self.key_docs, attn.window, k.shape[0], k.shape[1], k.device, query_index=self.query_index)
            return self.documents[attn.window](q, k, v, dropout_p)
        mask = self.mask(attn.window, q.dtype, q.device)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
            dropout_p=dropout_p, enable_gqa=q.shape[2] != k.shape[2])
        return out.transpose(1, 2)


@dataclass
class SequenceChunks:
    """What a context-parallel forward's layers share: the attention (`ContextParallelAttention`)
    and, for Mamba layers, the gathered keys' global indices and the whole sequence's document ids
    in global order (None: one document per row)."""

    cp: ContextParallel
    attention: ContextParallelAttention
    key_index: torch.Tensor  # [T] global index of each gathered (rank-order) position
    global_order: torch.Tensor = field(init=False)  # gathered positions in global order
    documents: torch.Tensor | None = field(init=False)

    def __post_init__(self) -> None:
        self.global_order = self.attention.global_order
        self.documents = self.attention.key_docs


def context_to_heads(x: torch.Tensor, chunks: SequenceChunks) -> torch.Tensor:
    """[B, T/C, C * n] (this rank's tokens, every rank's block of n channels) -> [B, T, n] (this
    rank's block over the whole sequence, global order): one all-to-all (Megatron's cp2hp)."""
    cp = chunks.cp
    b, tl, ch = x.shape
    n = ch // cp.size
    rows = [b * tl] * cp.size
    send = x.reshape(b, tl, cp.size, n).permute(2, 0, 1, 3).reshape(cp.size * b * tl, n)
    got = all_to_all_rows(send, rows, rows, cp.group)  # from rank s: its tokens of my block
    gathered = got.view(cp.size, b, tl, n).permute(1, 0, 2, 3).reshape(b, cp.size * tl, n)
    return gathered.index_select(1, chunks.global_order)


def heads_to_context(y: torch.Tensor, chunks: SequenceChunks) -> torch.Tensor:
    """The inverse of `context_to_heads`: [B, T, n] in global order -> [B, T/C, C * n]."""
    cp = chunks.cp
    b, t, n = y.shape
    tl = t // cp.size
    rows = [b * tl] * cp.size
    gathered = y.index_select(1, chunks.key_index)  # rank r's tokens at [r * tl, (r + 1) * tl)
    send = gathered.view(b, cp.size, tl, n).permute(1, 0, 2, 3).reshape(cp.size * b * tl, n)
    got = all_to_all_rows(send, rows, rows, cp.group)  # from rank s: my tokens of its block
    return got.view(cp.size, b, tl, n).permute(1, 2, 0, 3).reshape(b, tl, cp.size * n)
