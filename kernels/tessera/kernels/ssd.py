"""Mamba-2's selective state-space scan (SSD), as plain PyTorch references.

Per head h, with a state S of [head_dim P, state_size N], input x_t [P], step dt_t > 0, decay
rate A < 0 (one per head), and B_t, C_t [N] (shared by the heads of a group):

    S_t = exp(dt_t A) S_{t-1} + dt_t x_t B_t^T
    y_t = S_t C_t + D x_t

- `ssd_recurrence_reference`: that loop, one token at a time; the definition the others are
  tested against.
- `ssd_chunk_scan_reference`: the same in chunks of `chunk_size` tokens (the SSD algorithm of the
  Mamba-2 paper, as mamba_ssm and transformers compute it): inside a chunk a masked product like
  attention's, (C_t . B_s) exp(dt A summed over (s, t]), and one state per chunk carried forward.
- `ssd_step_reference`: one token from a given state (decoding).
- `discretize_dt`: the step from the projection, softplus(dt + dt_bias) clamped to the limits.

Packed documents (`seq_idx` [batch, T], integers non-decreasing along T, as mamba_ssm's): the
state resets where the id changes, so each document is scanned as if alone. An `initial_state`
belongs to the first token's document. Everything is computed in float32 (states included),
whatever the inputs' dtype, as transformers' reference does; outputs are float32.

Shapes: x [b, T, H, P]; dt [b, T, H]; A [H]; B, C [b, T, G, N] with G dividing H (head h reads
group h // (H / G)); D [H]; states [b, H, P, N].
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from tessera.kernels._dispatch import use_triton

__all__ = ["discretize_dt", "ssd_chunk_scan", "ssd_chunk_scan_reference", "ssd_recurrence_reference",
           "ssd_state_update", "ssd_state_update_reference", "ssd_step_reference"]

NO_LIMIT = (0.0, math.inf)


def discretize_dt(dt: torch.Tensor, dt_bias: torch.Tensor, dt_min: float = 0.0,
                  dt_max: float | None = None) -> torch.Tensor:
    """softplus(dt + dt_bias) in float32, clamped to [dt_min, dt_max] (None: no upper limit)."""
    return F.softplus(dt.float() + dt_bias.float()).clamp(min=dt_min, max=dt_max)


def _per_head(t: torch.Tensor, heads: int, dim: int) -> torch.Tensor:
    """B or C from groups to heads (each group serves heads / groups consecutive heads)."""
    return t.float().repeat_interleave(heads // t.shape[dim], dim=dim)


def ssd_step_reference(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
                       B: torch.Tensor, C: torch.Tensor, D: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """One token: (y [b, H, P], the new state [b, H, P, N]) from state [b, H, P, N], x [b, H, P],
    dt [b, H], A [H], B and C [b, G, N]. The input state is not modified."""
    heads = x.shape[1]
    x, dt = x.float(), dt.float()
    B, C = _per_head(B, heads, 1), _per_head(C, heads, 1)
    decay = torch.exp(dt * A.float())[..., None, None]
    state = state.float() * decay + (dt[..., None] * x)[..., None] * B[:, :, None, :]
    y = torch.einsum("bhpn,bhn->bhp", state, C)
    if D is not None:
        y = y + D.float()[:, None] * x
    return y, state


def ssd_recurrence_reference(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                             C: torch.Tensor, D: torch.Tensor | None = None,
                             initial_state: torch.Tensor | None = None, seq_idx: torch.Tensor | None = None
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(y [b, T, H, P], final state) by stepping through the tokens: the definition."""
    b, T, H, P = x.shape
    state = (initial_state.float() if initial_state is not None
             else x.new_zeros(b, H, P, B.shape[-1], dtype=torch.float32))
    ys = []
    for t in range(T):
        if seq_idx is not None and t > 0:  # a new document starts from a zero state
            state = state * (seq_idx[:, t] == seq_idx[:, t - 1]).to(state.dtype)[:, None, None, None]
        y, state = ssd_step_reference(state, x[:, t], dt[:, t], A, B[:, t], C[:, t], D)
        ys.append(y)
    return torch.stack(ys, dim=1), state


def _segment_sums(a: torch.Tensor) -> torch.Tensor:
    """a [..., l] -> [..., l, l] with [t, s] = a_{s+1} + ... + a_t for s <= t, -inf for s > t.

    Built by a masked cumulative sum rather than a difference of two cumulative sums, so the
    entries near the diagonal keep their precision."""
    length = a.shape[-1]
    rows = a[..., :, None].expand(*a.shape, length)  # [..., k, s] = a_k
    strictly_after = torch.ones(length, length, dtype=torch.bool, device=a.device).tril(-1)
    sums = rows.masked_fill(~strictly_after, 0.0).cumsum(dim=-2)  # [t, s] = sum of a_k, s < k <= t
    causal = torch.ones(length, length, dtype=torch.bool, device=a.device).tril()
    return sums.masked_fill(~causal, float("-inf"))


def ssd_chunk_scan_reference(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                             C: torch.Tensor, chunk_size: int, D: torch.Tensor | None = None,
                             initial_state: torch.Tensor | None = None, seq_idx: torch.Tensor | None = None
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(y [b, T, H, P], final state [b, H, P, N]), equal to `ssd_recurrence_reference`, chunk by chunk.

    The sequence is padded to whole chunks with dt = 0 tokens, which neither decay nor add to the
    state. Positions l, s index tokens inside a chunk, c chunks."""
    b, T, H, P = x.shape
    N = B.shape[-1]
    pad = (-T) % chunk_size
    if seq_idx is None:
        seq_idx = torch.zeros(b, T, dtype=torch.long, device=x.device)
    seq = F.pad(seq_idx, (0, pad), mode="replicate") if pad else seq_idx

    def chunks(t: torch.Tensor) -> torch.Tensor:  # [b, T, ...] -> [b, c, l, ...], zero-padded
        t = F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad)) if pad else t
        return t.reshape(b, -1, chunk_size, *t.shape[2:])

    x32 = x.float()
    xdt = chunks(x32 * dt.float()[..., None])  # [b, c, l, H, P]
    Bc, Cc = chunks(_per_head(B, H, 2)), chunks(_per_head(C, H, 2))  # [b, c, l, H, N]
    a = chunks(dt.float() * A.float()).permute(0, 3, 1, 2)  # log decay per token [b, H, c, l]
    seq = seq.reshape(b, -1, chunk_size)  # [b, c, l]
    n_chunks = seq.shape[1]
    cum = a.cumsum(dim=-1)

    # 1. Inside each chunk: token s reaches token t (s <= t, same document) with decay
    #    exp(a_{s+1} + ... + a_t).
    same_doc = (seq[:, :, :, None] == seq[:, :, None, :])[:, None]  # [b, 1, c, l, s]
    decay = torch.exp(_segment_sums(a)).masked_fill(~same_doc, 0.0)  # [b, H, c, l, s]
    scores = torch.einsum("bclhn,bcshn->bhcls", Cc, Bc) * decay
    y = torch.einsum("bhcls,bcshp->bclhp", scores, xdt)

    # 2. What each chunk adds to the state at its end: its tokens of its last document, decayed
    #    to the chunk's end.
    in_last_doc = (seq == seq[:, :, -1:])[:, None]  # [b, 1, c, l]
    to_end = torch.exp(cum[..., -1:] - cum) * in_last_doc  # [b, H, c, l]
    chunk_states = torch.einsum("bclhn,bhcl,bclhp->bchpn", Bc, to_end, xdt)

    # 3. The state entering each chunk, carried forward; it survives a chunk only when no
    #    document starts inside it (ids are non-decreasing, so comparing the chunk's last id with
    #    the previous chunk's suffices).
    state = (initial_state.float() if initial_state is not None
             else x32.new_zeros(b, H, P, N))
    prev_doc = seq[:, 0, 0]  # the initial state belongs to the first token's document
    entering, entering_doc = [], []
    for c in range(n_chunks):
        entering.append(state)
        entering_doc.append(prev_doc)
        survives = (seq[:, c, -1] == prev_doc).float()[:, None]  # [b, 1]
        state = state * (torch.exp(cum[:, :, c, -1]) * survives)[..., None, None] + chunk_states[:, c]
        prev_doc = seq[:, c, -1]

    # 4. The entering state's part of each output: tokens still in its document, decayed from the
    #    chunk's start to them (inclusive).
    states_in = torch.stack(entering, dim=1)  # [b, c, H, P, N]
    carries = (seq == torch.stack(entering_doc, dim=1)[..., None]).float()  # [b, c, l]
    from_start = torch.exp(cum).permute(0, 2, 3, 1) * carries[..., None]  # [b, c, l, H]
    y = y + torch.einsum("bclhn,bchpn->bclhp", Cc, states_in) * from_start[..., None]

    y = y.reshape(b, -1, H, P)[:, :T]
    if D is not None:
        y = y + D.float()[:, None] * x32
    return y, state


def _prepare_dt(dt: torch.Tensor, dt_bias: torch.Tensor | None, softplus: bool,
                dt_limit: tuple[float, float]) -> torch.Tensor:
    """dt (+ dt_bias), softplus if asked, clamped when limits are given (mamba_ssm's options)."""
    if dt_bias is not None:
        dt = dt.float() + dt_bias.float()
    if softplus:
        dt = F.softplus(dt.float())
    if tuple(dt_limit) != NO_LIMIT:
        dt = dt.float().clamp(min=dt_limit[0], max=dt_limit[1])
    return dt


def ssd_chunk_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                   chunk_size: int, D: torch.Tensor | None = None, initial_state: torch.Tensor | None = None,
                   seq_idx: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None,
                   dt_softplus: bool = False, dt_limit: tuple[float, float] = NO_LIMIT
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked scan (y, final state), as `ssd_chunk_scan_reference` after `dt` is prepared:
    dt + dt_bias, softplus when `dt_softplus`, clamped to `dt_limit`. Triton's forward and
    backward kernels on CUDA (tessera.kernels.ssm), the reference elsewhere and under
    torch.compile (and for empty inputs). Differentiable in every tensor argument."""
    if use_triton(x) and not torch.compiler.is_compiling() and x.numel() > 0:
        from tessera.kernels.ssm.ssd_bwd_triton import ssd_chunk_scan_triton

        return ssd_chunk_scan_triton(x, dt, A, B, C, chunk_size, D, initial_state, seq_idx, dt_bias, dt_softplus,
                                     dt_limit)
    dt = _prepare_dt(dt, dt_bias, dt_softplus, dt_limit)
    return ssd_chunk_scan_reference(x, dt, A, B, C, chunk_size, D, initial_state, seq_idx)


def ssd_state_update_reference(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
                               B: torch.Tensor, C: torch.Tensor, D: torch.Tensor | None = None,
                               z: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None,
                               dt_softplus: bool = False, dt_limit: tuple[float, float] = NO_LIMIT,
                               state_indices: torch.Tensor | None = None) -> torch.Tensor:
    """`ssd_step_reference` in place in a pool: see `ssd_state_update`."""
    dt = _prepare_dt(dt, dt_bias, dt_softplus, dt_limit)
    if state_indices is None:
        y, new = ssd_step_reference(state, x, dt, A, B, C, D)
        state.copy_(new)
    else:
        live = state_indices >= 0
        slots = state_indices[live].long()
        y_live, new = ssd_step_reference(state[slots], x[live], dt[live], A, B[live], C[live], D)
        state[slots] = new.to(state.dtype)
        y = y_live.new_zeros(x.shape)
        y[live] = y_live
    return y * F.silu(z.float()) if z is not None else y


def ssd_state_update(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                     C: torch.Tensor, D: torch.Tensor | None = None, z: torch.Tensor | None = None,
                     dt_bias: torch.Tensor | None = None, dt_softplus: bool = False,
                     dt_limit: tuple[float, float] = NO_LIMIT, state_indices: torch.Tensor | None = None
                     ) -> torch.Tensor:
    """One decoding token per sequence; returns y [b, H, P] (fp32) and advances the states in place.

    `state` [slots, H, P, N] is a pool (fp32, or a lower precision the pool chose); sequence i
    owns row `state_indices[i]` (rows 0..b-1 when None). A negative index marks a padding row
    (a CUDA-graph batch filled up): its state is untouched and its y is zero. x [b, H, P],
    dt [b, H] (prepared as in `ssd_chunk_scan`), B and C [b, G, N], z [b, H, P] gates the output
    by silu(z). Triton on CUDA, the reference elsewhere. Not differentiable (decoding)."""
    if use_triton(x) and not torch.compiler.is_compiling():
        from tessera.kernels.ssm.state_update_triton import ssd_state_update_triton

        return ssd_state_update_triton(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_limit, state_indices)
    return ssd_state_update_reference(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_limit, state_indices)
