"""Causal attention over packed documents and sliding windows, without a T x T mask; and
bidirectional attention over padded sequences (`BidirectionalAttention`, the encoders').

A packed sample holds several documents; each token attends only to earlier tokens of its own
document (`document_ids` [B, T], non-decreasing along T), and on a sliding-window layer only to
the last `window` of them (k > q - window, transformers' convention). The obvious implementation,
one additive [B, 1, T, T] mask (`attention_mask`, kept here as the tests' reference), costs
T*T*itemsize per window per forward and turns fused attention kernels off. `MaskedAttention`
does the same attention with no T x T tensor anywhere:

* CUDA: FlexAttention (`torch.nn.attention.flex_attention`) under a BlockMask built from the
  document ids, the window composed into the same mask_mod, the kernel compiled once per shape.
  The BlockMask holds (T/128)^2 block flags, not T^2 elements, and fully masked blocks are
  skipped, so the work is the documents' own causal triangles. Chosen over torch 2.13's public
  `torch.nn.attention.varlen.varlen_attn` (flash attention over cumulative lengths, with a
  window and GQA) because that one is flash only (fp16/bf16, no fp32, so the fp32 parity tests
  could not run it), takes the longest document as a Python int (a device-to-host sync every
  forward); FlexAttention runs every dtype from device tensors alone.
  Neither has attention dropout, so a training step with `attention_dropout > 0` on CUDA takes
  the segment path below (exact too, one fused SDPA call per segment shape).
* CPU (and the CUDA dropout case): the sequence is cut into segments, one per document of each
  row (and, on a window layer, query blocks of `window` tokens with their `2 * window` keys);
  segments of equal shape are gathered into one batch and attended with one fused SDPA call each
  (`is_causal` for a document, a shared [w, 2w] band mask for a window block), and the outputs
  are put back in place by one permutation. Memory: the gathered q/k/v (O(T)) and one band mask
  of O(window^2), never O(T^2). (With attention dropout SDPA leaves its fused kernel for the math
  one, which holds each segment's [L, L] scores: O(longest document^2), still no T x T.)

  Why segments on CPU: torch 2.13 has no FlexAttention backward there, and the segments beat
  the dense mask (measured in benchmarks/results/trainer.md, "packed-document attention").

Every query row keeps at least its diagonal, so no softmax row is empty.

`BidirectionalAttention` (encoders: every query sees every real key of its row) needs no
segments: one fused SDPA call under an additive [B, 1, 1, T] key mask, O(B x T).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

__all__ = ["BidirectionalAttention", "MaskedAttention", "attention_mask", "document_segments"]


def attention_mask(seq: int, dtype: torch.dtype, device: torch.device, document_ids: torch.Tensor | None = None,
                   window: int | None = None) -> torch.Tensor:
    """Additive mask [B or 1, 1, T, T] in `dtype`: 0 where a query may attend (causal, same document
    when `document_ids` [B, T] is given, at most `window - 1` tokens back when `window` is), -inf
    elsewhere.

    The dense reference `MaskedAttention` is tested against (O(T^2) memory: not used by the model).
    Additive and in the attention's dtype: SDPA converts a boolean mask to a new float tensor on
    every call.
    """
    q_idx = torch.arange(seq, device=device)
    allowed = (q_idx[None, :] <= q_idx[:, None]).unsqueeze(0)
    if window is not None:  # transformers' sliding window: k > q - window
        allowed = allowed & (q_idx[None, :] > q_idx[:, None] - window)
    if document_ids is not None:
        allowed = allowed & (document_ids.unsqueeze(2) == document_ids.unsqueeze(1))
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
    return mask.masked_fill_(~allowed, float("-inf")).unsqueeze(1)


def document_segments(document_ids: torch.Tensor | None, batch: int, seq: int) -> list[tuple[int, int, int]]:
    """(row, start, length) of every document of every row, in order; one per row without ids."""
    if document_ids is None:
        return [(b, 0, seq) for b in range(batch)]
    ids = document_ids.expand(batch, seq)
    change = torch.ones(batch, seq, dtype=torch.bool, device=ids.device)
    change[:, 1:] = ids[:, 1:] != ids[:, :-1]
    rows, starts = change.nonzero(as_tuple=True)  # row-major: each row's starts in order
    rows, starts = rows.tolist(), starts.tolist()
    out = []
    for i, (b, s) in enumerate(zip(rows, starts)):
        end = starts[i + 1] if i + 1 < len(rows) and rows[i + 1] == b else seq
        out.append((b, s, end - s))
    return out


class _Group:
    """Segments of one shape: flat query indices [n, Lq], key indices [n, Lk], band or causal."""

    def __init__(self, q_index: torch.Tensor, k_index: torch.Tensor, band: bool):
        self.q_index, self.k_index, self.band = q_index, k_index, band


class MaskedAttention:
    """Causal attention restricted to documents and/or a sliding window, for one forward.

    Built once per forward per distinct window and shared by every layer with that window (and by
    selective recompute, which calls it again in backward). `document_ids` [B or 1, T] or None;
    `window` None for full causal. Call with q [B, T, Hq, D], k/v [B, T, Hkv, D]; returns [B, T, Hq, D].

    `query_index` [Tq] (context parallel): the queries are only the tokens at these positions of
    the T keys (q [B, Tq, Hq, D], out likewise), in any order. FlexAttention looks each query's
    position up in the mask_mod (no extra work); the segment path scatters the queries into a
    zero [B, T] sequence and attends only the segments holding at least one of them (a zero
    query's output is discarded, so it costs work, not exactness).
    """

    def __init__(self, document_ids: torch.Tensor | None, window: int | None, batch: int, seq: int,
                 device: torch.device, query_index: torch.Tensor | None = None):
        self.document_ids, self.window = document_ids, window
        self.batch, self.seq, self.device = batch, seq, device
        self.query_index = query_index
        self._groups: list[_Group] | None = None
        self._take: torch.Tensor | None = None
        self._bands: dict[tuple[int, torch.dtype], torch.Tensor] = {}
        self._block_mask = None

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0) -> torch.Tensor:
        if q.device.type == "cuda" and dropout_p == 0.0:
            return self.flex(q, k, v)
        return self.segments(q, k, v, dropout_p)

    # ---- CUDA: FlexAttention ----------------------------------------------------------------

    def mask_mod(self) -> Callable:
        docs, window, query_index = self.document_ids, self.window, self.query_index

        def mask_mod(b, h, q_idx, kv_idx):
            if query_index is not None:
                q_idx = query_index[q_idx]
            allowed = kv_idx <= q_idx
            if window is not None:
                allowed = allowed & (kv_idx > q_idx - window)
            if docs is not None:
                allowed = allowed & (docs[b, q_idx] == docs[b, kv_idx])
            return allowed
        return mask_mod

    @torch.compiler.disable
    def block_mask(self, device: torch.device):
        """The BlockMask for this forward (built once, shared by the layers; outside any compiled
        graph, as torchtitan builds it, so a compiled forward takes it as an input)."""
        from torch.nn.attention.flex_attention import create_block_mask

        if self._block_mask is None:
            rows = self.document_ids.shape[0] if self.document_ids is not None else 1
            queries = self.seq if self.query_index is None else len(self.query_index)
            self._block_mask = create_block_mask(self.mask_mod(), rows, None, queries, self.seq,
                                                 device=device, _compile=device.type == "cuda")
        return self._block_mask

    def flex(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """FlexAttention under the block mask; compiled on CUDA (eager elsewhere, for tests only:
        eager FlexAttention materialises the scores)."""
        fn = _compiled_flex() if q.device.type == "cuda" else _flex()
        out = fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=self.block_mask(q.device),
                 enable_gqa=q.shape[2] != k.shape[2])
        return out.transpose(1, 2)

    # ---- CPU: fused SDPA per group of equal segments -----------------------------------------

    def plan(self) -> tuple[list[_Group], torch.Tensor]:
        """Group the segments by shape (once per forward): index tensors into the flattened
        [B * T] tokens, and the index that takes each query's output from the concatenated
        outputs of the groups, in query order."""
        if self._groups is None:
            local = [True] * self.seq
            if self.query_index is not None:
                local = [False] * self.seq
                for i in self.query_index.tolist():
                    local[i] = True
            shapes: dict[tuple[int, int, bool], tuple[list[int], list[int]]] = {}

            def add(b: int, qs: int, lq: int, ks: int, lk: int, band: bool) -> None:
                if any(local[qs:qs + lq]):  # a segment without queries of ours is skipped
                    q_starts, k_starts = shapes.setdefault((lq, lk, band), ([], []))
                    q_starts.append(b * self.seq + qs)
                    k_starts.append(b * self.seq + ks)

            w = self.window
            for b, start, length in document_segments(self.document_ids, self.batch, self.seq):
                if w is None or length <= w:
                    add(b, start, length, start, length, False)
                    continue
                # Query blocks of w: the first is plain causal; block j >= 1 (r <= w queries from
                # qs) sees keys qs - w .. qs + r - 1 under the band k' in (q', q' + w].
                add(b, start, w, start, w, False)
                for qs in range(start + w, start + length, w):
                    r = min(w, start + length - qs)
                    add(b, qs, r, qs - w, w + r, True)
            groups, order = [], []
            for (lq, lk, band), (q_starts, k_starts) in shapes.items():
                q_index = torch.tensor(q_starts)[:, None] + torch.arange(lq)
                k_index = torch.tensor(k_starts)[:, None] + torch.arange(lk) if band else q_index
                groups.append(_Group(q_index.to(self.device), k_index.to(self.device), band))
                order.append(q_index.flatten())
            flat = torch.cat(order)
            where = torch.empty(self.batch * self.seq, dtype=torch.long)
            where[flat] = torch.arange(len(flat))
            queries = torch.arange(self.seq) if self.query_index is None else self.query_index.cpu()
            wanted = (torch.arange(self.batch)[:, None] * self.seq + queries).flatten()
            self._groups, self._take = groups, where[wanted].to(self.device)
        assert self._take is not None
        return self._groups, self._take

    def band(self, queries: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Additive [r, w + r] mask of a window block: query q' sees keys k' with q' < k' <= q' + w."""
        key = (queries, dtype)
        if key not in self._bands:
            assert self.window is not None
            q = torch.arange(queries, device=device)[:, None]
            k = torch.arange(self.window + queries, device=device)[None, :]
            allowed = (k > q) & (k <= q + self.window)
            mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
            self._bands[key] = mask.masked_fill_(~allowed, float("-inf"))
        return self._bands[key]

    @torch.compiler.disable
    def segments(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0) -> torch.Tensor:
        """Eager even inside a compiled forward (a graph break per layer): the plan reads the
        document boundaries on the host, and its shapes change every batch, so tracing it would
        recompile per batch."""
        groups, take = self.plan()
        bsz, queries = q.shape[0], q.shape[1]
        if self.query_index is not None:  # our queries at their places in a zero sequence
            q = q.new_zeros(bsz, self.seq, *q.shape[2:]).index_copy(1, self.query_index, q)
        qf, kf, vf = q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1)  # [B * T, H, D]
        outs = []
        for g in groups:
            gq = qf[g.q_index].transpose(1, 2)  # [n, H, Lq, D]
            gk, gv = kf[g.k_index].transpose(1, 2), vf[g.k_index].transpose(1, 2)
            mask = self.band(g.q_index.shape[1], _attention_dtype(gq), gq.device) if g.band else None
            out = F.scaled_dot_product_attention(gq, gk, gv, attn_mask=mask, dropout_p=dropout_p,
                                                 is_causal=not g.band, enable_gqa=gq.shape[1] != gk.shape[1])
            outs.append(out.transpose(1, 2).flatten(0, 1))  # [n * Lq, H, D]
        return torch.cat(outs)[take].view(bsz, queries, *q.shape[2:])


class BidirectionalAttention:
    """Bidirectional attention over padded sequences, for one forward (built once, shared by the
    layers; called as MaskedAttention is).

    `key_mask` [B, Tk] (true / 1 at real tokens, false / 0 at padding; None: no padding) hides
    padded keys from every query; `bias` (None, or additive, broadcastable to [B, H, Tq, Tk]) is
    added to the scores: a relative-position bias (T5's), given for the heads the layer holds.
    Queries and keys may differ in length (cross-attention). `scale` multiplies the scores (None:
    1/sqrt(head dim); T5 uses 1). Padding gets the dtype's most negative
    value rather than -inf, as transformers masks it, so a row of padding only is finite.
    Call with q [B, Tq, Hq, D], k/v [B, Tk, Hkv, D]; returns [B, Tq, Hq, D].
    """

    def __init__(self, key_mask: torch.Tensor | None, bias: torch.Tensor | None = None, scale: float | None = None):
        self.key_mask, self.bias, self.scale = key_mask, bias, scale
        self._masks: dict[torch.dtype, torch.Tensor | None] = {}

    def additive(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        """The additive mask in `dtype`: [B, 1, 1, Tk] padding (+ the bias), None without either."""
        if dtype not in self._masks:
            mask = None
            if self.key_mask is not None:
                keep = self.key_mask.to(device=device, dtype=torch.bool)[:, None, None, :]
                mask = torch.zeros(keep.shape, dtype=dtype, device=device).masked_fill_(~keep, torch.finfo(dtype).min)
            if self.bias is not None:
                bias = self.bias.to(device=device, dtype=dtype)
                mask = bias if mask is None else mask + bias
            self._masks[dtype] = mask
        return self._masks[dtype]

    def built_for(self, x: torch.Tensor) -> BidirectionalAttention:
        """Self, its additive mask built for the attention dtype of `x` (the hidden states): made
        before the blocks, so every block sees the same state, and blocks compiled one by one
        (regional compilation) share one graph instead of the first one building the mask."""
        self.additive(_attention_dtype(x), x.device)
        return self

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0) -> torch.Tensor:
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=self.additive(_attention_dtype(q), q.device),
                                             dropout_p=dropout_p, scale=self.scale, enable_gqa=q.shape[1] != k.shape[1])
        return out.transpose(1, 2)


def _attention_dtype(q: torch.Tensor) -> torch.dtype:
    """The dtype SDPA runs in: autocast's when enabled, else the query's."""
    device_type = q.device.type
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else q.dtype


def _flex():
    from torch.nn.attention.flex_attention import flex_attention
    return flex_attention


_COMPILED: list[Callable] = []


def _compiled_flex() -> Callable:
    """flex_attention compiled once per process (torch.compile then specialises per shape)."""
    if not _COMPILED:
        _COMPILED.append(torch.compile(_flex(), dynamic=False))
    return _COMPILED[0]
