"""Mamba-2's PyTorch references (tessera.kernels.ssd, causal_conv1d, gated_rms_norm_reference)
against each other and against transformers' own references: the chunked scan equals the
token-by-token recurrence, documents packed in one row equal each document scanned alone, a
sequence scanned in two parts carries its state exactly, and the convolution's one-token step
decodes what the whole-sequence form computes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tessera.kernels import (
    causal_conv1d_reference,
    causal_conv1d_step_reference,
    gated_rms_norm_reference,
    ssd_chunk_scan_reference,
    ssd_recurrence_reference,
)

ATOL = 1e-5


def _scan_inputs(b: int, T: int, H: int, P: int, G: int, N: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, T, H, P, generator=g)
    dt = torch.rand(b, T, H, generator=g) * 0.5 + 0.01
    A = -(torch.rand(H, generator=g) * 2 + 0.1)
    B, C = torch.randn(b, T, G, N, generator=g), torch.randn(b, T, G, N, generator=g)
    return x, dt, A, B, C, torch.randn(H, generator=g)


@pytest.mark.parametrize("T, chunk, H, G", [(37, 8, 4, 2), (5, 16, 2, 1), (32, 8, 6, 3), (1, 4, 2, 2)])
def test_the_chunked_scan_equals_the_token_by_token_recurrence_and_transformers_reference(T, chunk, H, G):
    from transformers.models.mamba2.modeling_mamba2 import mamba2_chunk_scan

    x, dt, A, B, C, D = _scan_inputs(2, T, H, 3, G, 5)
    init = torch.randn(2, H, 3, 5, generator=torch.Generator().manual_seed(1))
    y, final = ssd_chunk_scan_reference(x, dt, A, B, C, chunk, D, initial_state=init)
    y_ref, final_ref = ssd_recurrence_reference(x, dt, A, B, C, D, initial_state=init)
    torch.testing.assert_close(y, y_ref, atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(final, final_ref, atol=ATOL, rtol=ATOL)
    y_hf, final_hf = mamba2_chunk_scan(x, dt, A, B, C, chunk, D=D, initial_states=init, return_final_states=True)
    torch.testing.assert_close(y, y_hf, atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(final, final_hf, atol=ATOL, rtol=ATOL)


def test_packed_documents_scan_as_if_each_ran_alone_whatever_the_chunk_boundaries():
    x, dt, A, B, C, D = _scan_inputs(1, 29, 4, 3, 2, 5)
    lengths = [3, 5, 1, 20]  # boundaries inside chunks, on an 8-token chunk edge, a one-token document
    seq_idx = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None]
    init = torch.randn(1, 4, 3, 5)
    for chunk in (4, 8, 64):
        y, final = ssd_chunk_scan_reference(x, dt, A, B, C, chunk, D, initial_state=init, seq_idx=seq_idx)
        y_rec, final_rec = ssd_recurrence_reference(x, dt, A, B, C, D, initial_state=init, seq_idx=seq_idx)
        torch.testing.assert_close(y, y_rec, atol=ATOL, rtol=ATOL)
        torch.testing.assert_close(final, final_rec, atol=ATOL, rtol=ATOL)
        start = 0
        for i, n in enumerate(lengths):  # alone: the first document from the initial state, the rest from zero
            part = slice(start, start + n)
            alone, alone_final = ssd_chunk_scan_reference(x[:, part], dt[:, part], A, B[:, part], C[:, part], chunk, D,
                                                          initial_state=init if i == 0 else None)
            torch.testing.assert_close(y[:, part], alone, atol=ATOL, rtol=ATOL)
            start += n
        torch.testing.assert_close(final, alone_final, atol=ATOL, rtol=ATOL)  # the last document's state


def test_a_sequence_scanned_in_two_parts_carries_its_state_exactly():
    x, dt, A, B, C, D = _scan_inputs(2, 40, 4, 3, 2, 5)
    whole, whole_final = ssd_chunk_scan_reference(x, dt, A, B, C, 8, D)
    first, state = ssd_chunk_scan_reference(x[:, :13], dt[:, :13], A, B[:, :13], C[:, :13], 8, D)
    second, final = ssd_chunk_scan_reference(x[:, 13:], dt[:, 13:], A, B[:, 13:], C[:, 13:], 8, D, initial_state=state)
    torch.testing.assert_close(torch.cat([first, second], 1), whole, atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(final, whole_final, atol=ATOL, rtol=ATOL)


def test_the_causal_convolution_is_torch_conv1d_and_its_step_decodes_it_token_by_token():
    g = torch.Generator().manual_seed(0)
    x, w, bias = torch.randn(2, 11, 6, generator=g), torch.randn(6, 4, generator=g), torch.randn(6, generator=g)
    y, last = causal_conv1d_reference(x, w, bias)
    conv = F.conv1d(x.transpose(1, 2), w[:, None], bias, padding=3, groups=6)[..., :11].transpose(1, 2)
    torch.testing.assert_close(y, F.silu(conv), atol=ATOL, rtol=ATOL)
    state, ys = torch.zeros(2, 6, 3), []
    for t in range(11):
        out, state = causal_conv1d_step_reference(x[:, t], state, w, bias)
        ys.append(out)
    torch.testing.assert_close(torch.stack(ys, 1), y, atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(state, last, atol=0, rtol=0)
    # Two parts, the second from the first's state, equal the whole.
    first, mid = causal_conv1d_reference(x[:, :2], w, bias)
    second, _ = causal_conv1d_reference(x[:, 2:], w, bias, initial_state=mid)
    torch.testing.assert_close(torch.cat([first, second], 1), y, atol=ATOL, rtol=ATOL)


def test_the_convolution_of_packed_documents_sees_only_its_own_document():
    g = torch.Generator().manual_seed(0)
    x, w, bias = torch.randn(1, 9, 5, generator=g), torch.randn(5, 4, generator=g), torch.randn(5, generator=g)
    seq_idx = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 2, 2]])
    y, last = causal_conv1d_reference(x, w, bias, seq_idx=seq_idx)
    for lo, hi in ((0, 2), (2, 7), (7, 9)):
        alone, alone_last = causal_conv1d_reference(x[:, lo:hi], w, bias)
        torch.testing.assert_close(y[:, lo:hi], alone, atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(last, alone_last, atol=0, rtol=0)  # the last document's two inputs, zeros before


def test_the_gated_rms_norm_is_transformers_group_wise_gated_norm():
    from transformers.models.mamba2.modeling_mamba2 import MambaRMSNormGated

    g = torch.Generator().manual_seed(0)
    x, z = torch.randn(2, 5, 24, generator=g), torch.randn(2, 5, 24, generator=g)
    norm = MambaRMSNormGated(24, group_size=8, eps=1e-5)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.3, generator=g)
        torch.testing.assert_close(gated_rms_norm_reference(x, z, norm.weight, 1e-5, 8), norm(x, z), atol=0, rtol=0)
