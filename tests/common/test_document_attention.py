"""Packed-document and sliding-window attention without a T x T mask (tessera.common.layers.attention).

The reference is the dense additive mask (`attention_mask`) under plain SDPA, run through the
model's `attention_fn` hook, so every test compares the model's own path (MaskedAttention) against
an independent implementation of the same mask, forward and gradients.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from tessera.common.layers.attention import MaskedAttention, attention_mask, document_segments
from tessera.common.models.causal_lm.config import preset
from tessera.common.models.causal_lm.model import build_model
from tessera.common.parallel.context_parallel import local_token_index

T = 48


def gpt2(**kw):
    return preset("tiny", vocab_size=97, arch="gpt2", norm="layernorm", position="learned", activation="gelu",
                  bias=True, tie_embeddings=True, num_kv_heads=4, max_seq_len=128, **kw)


def llama_gqa(**kw):
    return preset("tiny", vocab_size=97, num_kv_heads=2, **kw)


def ids_from_lengths(rows: list[list[int]]) -> torch.Tensor:
    return torch.tensor([[d for d, n in enumerate(row) for _ in range(n)] for row in rows])


def positions_from_lengths(rows: list[list[int]]) -> torch.Tensor:
    return torch.tensor([[i for n in row for i in range(n)] for row in rows])


def dense_reference(model, document_ids: torch.Tensor | None, seq: int):
    """An attention_fn attending under the dense [B, 1, T, T] mask of each layer's window."""
    windows = {int(n): b.attn.window for n, b in model.layers.items()}

    def attend(layer_idx, q, k, v):
        device_type = q.device.type
        dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else q.dtype
        mask = attention_mask(seq, dtype, q.device, document_ids, windows[layer_idx])
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=mask, enable_gqa=q.shape[2] != k.shape[2])
        return out.transpose(1, 2)
    return attend


def logits_and_grads(model, tokens, targets, **inputs):
    model.zero_grad(set_to_none=True)
    logits = model(tokens, **inputs)
    F.cross_entropy(logits.float().flatten(0, 1), targets.flatten()).backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_matches_dense(model, rows, window_layers: bool = True, tol: float = 1e-5):
    document_ids = ids_from_lengths(rows) if rows is not None else None
    batch = len(rows) if rows is not None else 2
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, model.cfg.vocab_size, (batch, T), generator=gen)
    targets = torch.randint(0, model.cfg.vocab_size, (batch, T), generator=gen)
    positions = positions_from_lengths(rows) if rows is not None else None
    got, got_grads = logits_and_grads(model, tokens, targets, positions=positions, document_ids=document_ids)
    want, want_grads = logits_and_grads(model, tokens, targets, positions=positions,
                                        attention_fn=dense_reference(model, document_ids, T))
    assert ((got - want).norm() / want.norm()).item() < tol
    for name, g in want_grads.items():
        if name.endswith("k_proj.bias"):  # zero in exact arithmetic (softmax ignores a per-query
            assert got_grads[name].norm() < 1e-8 and g.norm() < 1e-8  # constant): rounding noise
            continue
        assert ((got_grads[name] - g).norm() / g.norm()).item() < tol, name


PACKED = [[7, 12, 5, 24], [30, 18]]  # documents per row, T tokens each


@pytest.mark.parametrize("family", [gpt2, llama_gqa], ids=["gpt2", "llama-gqa"])
def test_packed_documents_equal_the_dense_mask_forward_and_gradients(family):
    assert_matches_dense(build_model(family(), seed=1), PACKED)


@pytest.mark.parametrize("family", [gpt2, llama_gqa], ids=["gpt2", "llama-gqa"])
def test_sliding_window_with_and_without_documents_equals_the_dense_mask(family):
    # Window 5 on layer 1 only: documents longer and shorter than the window, blocks of 5 with a
    # partial last block; layer 0 keeps full causal attention (two MaskedAttentions per forward).
    model = build_model(family(sliding_window=5, sliding_window_layers=[1]), seed=2)
    assert_matches_dense(model, PACKED)
    assert_matches_dense(model, None)  # window alone: the whole row is one segment


def test_single_document_batch_equals_the_dense_mask():
    model = build_model(llama_gqa(sliding_window=16), seed=3)
    assert_matches_dense(model, [[T], [T]])


def test_documents_crossing_row_edges_stay_in_their_row():
    """Global document ids continuing from one row into the next (a document cut by the sample
    edge, ids not restarted per row) still attend only within their row, as the dense mask does;
    and a micro-batch of the rows gives those rows' logits."""
    model = build_model(llama_gqa(), seed=4)
    rows = [[10, 38], [20, 28]]
    document_ids = ids_from_lengths(rows)
    document_ids[1] += 1  # row 1 starts with row 0's last document id
    assert document_ids[0, -1] == document_ids[1, 0]
    tokens = torch.randint(0, 97, (2, T), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = model(tokens, document_ids=document_ids)
        want = model(tokens, attention_fn=dense_reference(model, document_ids, T))
        micro = model(tokens[1:], document_ids=document_ids[1:])
    assert ((got - want).norm() / want.norm()).item() < 1e-5
    assert ((micro[0] - got[1]).norm() / got[1].norm()).item() < 1e-5
    assert document_segments(document_ids, 2, T) == [(0, 0, 10), (0, 10, 38), (1, 0, 20), (1, 20, 28)]


def test_bf16_autocast_equals_the_dense_mask():
    model = build_model(llama_gqa(sliding_window=6, sliding_window_layers=[0]), seed=5).eval()
    document_ids = ids_from_lengths(PACKED)
    tokens = torch.randint(0, 97, (2, T), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        got = model(tokens, document_ids=document_ids)
        want = model(tokens, attention_fn=dense_reference(model, document_ids, T))
    torch.testing.assert_close(got.float(), want.float(), rtol=0.05, atol=0.05)


def test_flex_attention_block_mask_equals_the_dense_mask():
    """The CUDA path's mask_mod (documents and window composed) run by eager FlexAttention on CPU,
    forward only (FlexAttention has no CPU backward in torch 2.13)."""
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(2, T, 4, 16, generator=gen)
    k, v = torch.randn(2, T, 2, 16, generator=gen), torch.randn(2, T, 2, 16, generator=gen)
    document_ids = ids_from_lengths(PACKED)
    for window in (None, 5):
        masked = MaskedAttention(document_ids, window, 2, T, q.device)
        got = masked.flex(q, k, v)
        mask = attention_mask(T, q.dtype, q.device, document_ids, window)
        want = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                              attn_mask=mask, enable_gqa=True).transpose(1, 2)
        assert ((got - want).norm() / want.norm()).item() < 1e-5
        assert ((masked.segments(q, k, v) - want).norm() / want.norm()).item() < 1e-5


class LargestTensor(TorchDispatchMode):
    """Records the largest tensor (bytes) any op outputs while active: forward and backward."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel() * t.element_size())
        return out


def test_long_packed_sequence_allocates_no_t_by_t_buffer():
    """T = 8192 on a tiny model, two documents, one window layer: no op output in forward or
    backward comes near T*T*4 bytes (the dense path's mask alone is that, and the counter sees it)."""
    seq = 8192
    cfg = preset("tiny", vocab_size=64, hidden_size=32, num_heads=2, num_kv_heads=1, num_layers=2,
                 ffn_hidden_size=64, max_seq_len=seq, sliding_window=256, sliding_window_layers=[1])
    model = build_model(cfg, seed=0)
    rows = [[3000, seq - 3000]]
    tokens = torch.randint(0, 64, (1, seq), generator=torch.Generator().manual_seed(0))
    dense_bytes = seq * seq * 4
    with LargestTensor() as ours:
        logits = model(tokens, positions=positions_from_lengths(rows), document_ids=ids_from_lengths(rows))
        logits.sum().backward()
    with LargestTensor() as dense:
        attention_mask(seq, torch.float32, torch.device("cpu"), ids_from_lengths(rows))
    assert dense.largest >= dense_bytes
    # The largest tensors left are per-token: measured 2 MiB (the [T, 64] logits) against 256 MiB.
    assert ours.largest < dense_bytes // 32


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "one-document"])
@pytest.mark.parametrize("window", [None, 5])
def test_context_parallel_queries_equal_their_rows_of_the_dense_mask(window, packed):
    """Context parallel's document path: a rank's queries (chunks r and 2C-1-r of the sequence)
    against every key in global order equal those queries' rows of the one-process attention,
    output and gradients, on the segment path (CPU) and, forward, the FlexAttention path (which
    CUDA also takes for one document per sample, instead of the [T/C, T] mask)."""
    cp = 2
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, T, 4, 16, generator=gen, requires_grad=True)
    k = torch.randn(2, T, 2, 16, generator=gen, requires_grad=True)
    v = torch.randn(2, T, 2, 16, generator=gen, requires_grad=True)
    document_ids = ids_from_lengths(PACKED) if packed else None
    mask = attention_mask(T, q.dtype, q.device, document_ids, window)
    full = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                          attn_mask=mask, enable_gqa=True).transpose(1, 2)
    for rank in range(cp):
        index = local_token_index(T, cp, rank)
        masked = MaskedAttention(document_ids, window, 2, T, q.device, query_index=index)
        got = masked(q[:, index], k, v)
        want = full[:, index]
        assert ((got - want).norm() / want.norm()).item() < 1e-5
        weight = torch.randn(got.shape, generator=gen)
        got_grads = torch.autograd.grad((got * weight).sum(), (q, k, v))
        want_grads = torch.autograd.grad((want * weight).sum(), (q, k, v), retain_graph=True)
        for a, b in zip(got_grads, want_grads):
            assert ((a - b).norm() / b.norm()).item() < 1e-5
        flex = masked.flex(q[:, index].detach(), k.detach(), v.detach())
        assert ((flex - want).norm() / want.norm()).item() < 1e-5
