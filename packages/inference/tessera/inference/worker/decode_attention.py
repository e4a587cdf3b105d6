"""CPU decode attention: the new tokens of decoding sequences (one each, or 1 + k speculative rows)
attended over their cached keys/values in groups of similar length, one gather + one SDPA per
group, in place of one paged-attention reference call per sequence."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from tessera.inference.worker.kv_cache import dequantize_kv
from tessera.kernels import paged_attention

# Decode sequences per gather + SDPA call: sorted by length, 8 at a time, each group's window is only
# as wide as its own longest sequence and its K/V copy stays in cache (benchmarks/results/serving.md).
DECODE_GROUP = 8


@dataclass
class DecodeGroup:
    """Decode sequences attended in one call: their packed rows and their gathered window. Each
    has `num_q` new tokens (1; with speculative decoding 1 + k: its newest token and k drafts)."""

    rows: torch.Tensor  # long [S * num_q]: rows of the packed batch, sequence by sequence
    blocks: torch.Tensor  # long [S * width]: pool blocks, row-major by sequence
    width: int  # blocks per sequence in the window
    block_size: int  # slots per block: the window is width * block_size positions
    seq_lens: torch.Tensor  # [S]: tokens in the cache, the new ones included
    num_q: int = 1
    # Additive float masks (0 visible, -inf not), built by the first layer that needs one and
    # shared by the rest of the step: key (sliding window, query heads per KV head, dtype).
    masks: dict[tuple[int | None, int, torch.dtype], torch.Tensor] = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_rows(self) -> int:
        return self.rows.numel()

    def mask(self, window: int | None, heads_per_kv: int, dtype: torch.dtype) -> torch.Tensor:
        """[S, 1, num_q * heads_per_kv (1 when num_q is 1), width * block_size]: the cached positions
        each query sees. Query i of a sequence sits at position seq_len - num_q + i and sees positions up
        to its own (with a sliding window only the last `window` of them); the rest of the window is
        padding. Queries are folded as `decode_attention` folds them (t * heads_per_kv + g)."""
        key = (window, heads_per_kv, dtype)
        mask = self.masks.get(key)
        if mask is None:
            dev = self.seq_lens.device
            last = self.seq_lens[:, None] - self.num_q + torch.arange(self.num_q, device=dev)[None, :]
            pos = torch.arange(self.width * self.block_size, device=dev)
            visible = pos <= last[:, :, None]
            if window is not None:
                visible &= pos > (last - window)[:, :, None]
            if self.num_q > 1:
                visible = visible.repeat_interleave(heads_per_kv, dim=1)
            mask = torch.zeros(visible.shape, dtype=dtype, device=dev).masked_fill_(~visible, float("-inf"))
            mask = self.masks[key] = mask[:, None]
        return mask


def decode_group(rows: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
                 num_q: int = 1) -> DecodeGroup:
    width = -(-int(seq_lens.max()) // block_size)
    blocks = block_tables[:, :width].reshape(-1).long()
    return DecodeGroup(rows=rows.reshape(-1), blocks=blocks, width=width, block_size=block_size, seq_lens=seq_lens,
                       num_q=num_q)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group: DecodeGroup,
                     scale: float, sliding_window: int | None = None,
                     kv_scales: tuple[float, float] = (1.0, 1.0)) -> torch.Tensor:
    """Attention of the new tokens of each sequence over its cached keys/values (a group at once).

    q [S * num_q, H, D]; caches [blocks, block_size, Hkv, D]. Gathers each sequence's blocks into
    a padded [S, width*block_size] window (index_select on the flat block list is ~3x faster on CPU
    than advanced indexing by the table) and masks the padding and, for several new tokens, the
    positions after each, and with a sliding `window` the positions more than `sliding_window`
    before each (`DecodeGroup.mask`, once per step). An fp8 cache is dequantized (`kv_scales`: the
    K and V scales) after the gather, so only the window is converted. Returns [S * num_q, H, D].

    Grouped-query heads are folded into the query length: the H / Hkv query heads that share a KV
    head attend as H / Hkv queries of one head ([S, Hkv, num_q * H/Hkv, D] against [S, Hkv, W, D]),
    so SDPA's CPU flash kernel reads each K/V block once for all of them. Measurements, and the
    in-place alternatives rejected: benchmarks/results/serving.md.
    """
    _, num_heads, head_dim = q.shape
    num_seqs, num_q = group.seq_lens.shape[0], group.num_q
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    per_kv = num_heads // num_kv_heads
    window = group.width * block_size
    k = k_cache.index_select(0, group.blocks).view(num_seqs, window, num_kv_heads, head_dim).transpose(1, 2)
    if v_cache is k_cache and kv_scales[0] == kv_scales[1]:  # a latent cache (worker/latent/): one gather
        k = v = dequantize_kv(k, q.dtype, kv_scales[0])
    else:
        v = v_cache.index_select(0, group.blocks).view(num_seqs, window, num_kv_heads, head_dim).transpose(1, 2)
        k, v = dequantize_kv(k, q.dtype, kv_scales[0]), dequantize_kv(v, q.dtype, kv_scales[1])
    assert block_size == group.block_size, (block_size, group.block_size)
    mask = group.mask(sliding_window, per_kv, q.dtype)
    if num_q == 1:
        out = F.scaled_dot_product_attention(q.view(num_seqs, num_kv_heads, per_kv, head_dim), k, v,
                                             attn_mask=mask, scale=scale)
        return out.reshape(num_seqs, num_heads, head_dim)
    # Query t of a sequence, head kv * per_kv + g -> query t * per_kv + g of KV head kv.
    q = q.view(num_seqs, num_q, num_kv_heads, per_kv, head_dim).transpose(1, 2)
    out = F.scaled_dot_product_attention(q.reshape(num_seqs, num_kv_heads, num_q * per_kv, head_dim), k, v,
                                         attn_mask=mask, scale=scale)
    out = out.view(num_seqs, num_kv_heads, num_q, per_kv, head_dim).transpose(1, 2)
    return out.reshape(num_seqs * num_q, num_heads, head_dim)


def decode_groups(block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
                  rows: torch.Tensor, num_q: int = 1) -> list[DecodeGroup]:
    """Split decode sequences into groups of DECODE_GROUP by ascending length; rows [S] or
    [S, num_q] (each sequence's new tokens). Up to DECODE_GROUP sequences are one group, in their
    order (the window is as wide as the longest either way). The lengths are sorted on the host and
    the step gathered once, each group a slice of it (a gather and a max per group cost more than the
    grouping saved at 64 sequences)."""
    if seq_lens.shape[0] <= DECODE_GROUP:
        return [decode_group(rows, block_tables, seq_lens, block_size, num_q)]
    lens = seq_lens.tolist()
    order = sorted(range(len(lens)), key=lens.__getitem__)  # stable, as argsort(stable=True)
    idx = torch.tensor(order, device=seq_lens.device)
    tables, lens_t, rows = block_tables.index_select(0, idx), seq_lens.index_select(0, idx), rows.index_select(0, idx)
    groups = []
    for g in range(0, len(order), DECODE_GROUP):
        end = min(g + DECODE_GROUP, len(order))
        width = -(-lens[order[end - 1]] // block_size)  # the group's longest: its last
        groups.append(DecodeGroup(rows=rows[g:end].reshape(-1), blocks=tables[g:end, :width].reshape(-1).long(),
                                  width=width, block_size=block_size, seq_lens=lens_t[g:end], num_q=num_q))
    return groups


@dataclass
class DecodeSplit:
    """Which packed rows are decode tokens (grouped path) and which are prefill chunks (kernel).

    Attention takes the rows in `order` (each decode group's rows, group by group, then the
    prefill rows), so each group's queries are one slice, and its output goes back to the packed
    order through `inverse`; both None when `order` is the packed order itself (one group, in
    order, before any prefill row): one index_select each way per layer in place of an index
    and an index_put per group."""

    decode_groups: list[DecodeGroup]
    prefill_tables: torch.Tensor
    prefill_lens: torch.Tensor
    prefill_starts: torch.Tensor
    order: torch.Tensor | None = None
    inverse: torch.Tensor | None = None



def decode_split(num_q: list[int], starts: list[int], tables: torch.Tensor, lens: torch.Tensor,
                 block_size: int) -> DecodeSplit:
    """The step's split: num_q per sequence, its new tokens when it decodes (1, or 1 + k drafts),
    else 0; starts, each sequence's first row in the packed batch (and the end)."""
    dev = tables.device
    pre = [i for i, n in enumerate(num_q) if n == 0]
    pre_rows: list[int] = []
    pre_starts = [0]
    for i in pre:
        pre_rows.extend(range(starts[i], starts[i + 1]))
        pre_starts.append(len(pre_rows))
    groups: list[DecodeGroup] = []
    for q_len in sorted(set(num_q) - {0}):  # speculative rows of equal length go together
        dec = [i for i, n in enumerate(num_q) if n == q_len]
        dec_t = torch.tensor(dec, dtype=torch.long, device=dev)
        rows = torch.tensor([list(range(starts[i], starts[i] + q_len)) for i in dec], dtype=torch.long, device=dev)
        groups.extend(decode_groups(tables[dec_t], lens[dec_t], block_size, rows, q_len))
    pre_t = torch.tensor(pre, dtype=torch.long, device=dev)
    order = torch.cat([g.rows for g in groups] + [torch.tensor(pre_rows, dtype=torch.long, device=dev)])
    identity = torch.arange(order.shape[0], device=dev)
    inverse = None
    if torch.equal(order, identity):
        order = None
    else:
        inverse = torch.empty_like(order)
        inverse[order] = identity
    return DecodeSplit(
        decode_groups=groups,
        prefill_tables=tables[pre_t], prefill_lens=lens[pre_t],
        prefill_starts=torch.tensor(pre_starts, dtype=torch.int32, device=dev),
        order=order, inverse=inverse,
    )


def split_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, split: DecodeSplit,
                    scale: float, window: int | None = None,
                    kv_scales: tuple[float, float] = (1.0, 1.0)) -> torch.Tensor:
    """Attention of a step's packed rows q [T, H, D] (K/V already written): decode groups through
    `decode_attention`, prefill chunks through `paged_attention`; [T, H, D] in the packed order."""
    k_scale, v_scale = kv_scales
    q = q if split.order is None else q.index_select(0, split.order)
    outs = []
    start = 0
    for group in split.decode_groups:
        end = start + group.num_rows
        outs.append(decode_attention(q[start:end], k_cache, v_cache, group, scale, window, kv_scales))
        start = end
    if start < q.shape[0]:
        outs.append(paged_attention(q[start:], k_cache, v_cache, split.prefill_tables, split.prefill_lens,
                                    split.prefill_starts, scale, window, k_scale=k_scale, v_scale=v_scale))
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    if split.inverse is not None:
        out = out.index_select(0, split.inverse)
    return out


class SteadySplit:
    """`decode_split` of a steady decode batch (batch.DecodeBatch: the same sequences, one token
    each, every length one more each step), kept across its steps. Sorting by length, the groups and
    the row order stay as they were (every length grew by one), so a step adds one to the sorted
    lengths (the groups' `seq_lens` are views of them) and re-gathers the block window only of the
    groups where a sequence entered a new block; the groups are the ones `decode_split` makes, in
    the same order, so attention is unchanged. Host bookkeeping in numpy, shared with torch."""

    def __init__(self, lens: list[int], tables: np.ndarray, block_size: int):
        n = len(lens)
        order = list(range(n)) if n <= DECODE_GROUP else sorted(range(n), key=lens.__getitem__)
        self.order = np.array(order, dtype=np.int64)
        self.rank = [0] * n  # row -> its place in `order`
        for place, row in enumerate(order):
            self.rank[row] = place
        self.block_size = block_size
        self.bounds = [(g, min(g + DECODE_GROUP, n)) for g in range(0, n, DECODE_GROUP)] if n > DECODE_GROUP else [(0, n)]
        idx = torch.from_numpy(self.order)
        identity = order == list(range(n))
        inverse = None
        if not identity:
            inverse = torch.empty_like(idx)
            inverse[idx] = torch.arange(n)
        self.lens = np.array(lens, dtype=np.int32)[self.order]  # sorted; advanced in place, seen by the groups
        lens_t = torch.from_numpy(self.lens)
        self.groups = [DecodeGroup(rows=idx[g:end], blocks=idx, width=0, block_size=block_size, seq_lens=lens_t[g:end])
                       for g, end in self.bounds]
        empty = torch.zeros(0, dtype=torch.int32)
        self.split = DecodeSplit(decode_groups=self.groups, prefill_tables=empty.view(0, 1), prefill_lens=empty,
                                 prefill_starts=torch.zeros(1, dtype=torch.int32), order=None if identity else idx,
                                 inverse=inverse)
        self._gather(range(len(self.bounds)), tables)

    def _gather(self, groups, tables: np.ndarray) -> None:
        """Each of `groups`' block window: its sequences' first `width` table entries, flat."""
        bs = self.block_size
        for gi in groups:
            g, end = self.bounds[gi]
            group = self.groups[gi]
            group.width = -(-int(self.lens[g:end].max()) // bs)
            group.blocks = torch.from_numpy(tables[self.order[g:end], :group.width].reshape(-1).astype(np.int64))

    def step(self, fresh: list[int], tables: np.ndarray) -> DecodeSplit:
        """The next step's split: every length one more; `fresh`, the rows that entered a new block
        (their table entry written)."""
        self.lens += 1
        if fresh:
            self._gather({self.rank[i] // DECODE_GROUP for i in fresh}, tables)
        for group in self.groups:
            group.masks.clear()  # they follow the lengths
        return self.split
