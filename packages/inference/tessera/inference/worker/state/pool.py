"""The state pool of a hybrid model's Mamba layers: for each, a convolution window per part
[slots, channels, conv_kernel - 1] in the model's dtype and a scan state [slots, heads, head_dim,
state_size] in fp32 (mamba.MambaState over all slots). A sequence owns one slot while it runs
(core/state_manager.py hands them out); its size does not depend on the sequence's length.

A step reads its sequences' slots into a batch (copies: a sequence starting at position 0 reads
zeros, whatever a previous owner left), the forward advances the copies, and the runner writes
them back only when the whole step has succeeded, so a step that raises and is retried sequence
by sequence starts again from the same states.
"""

from __future__ import annotations

import torch
from torch import nn

from tessera.common.models.hybrid.config import HybridConfig
from tessera.common.models.hybrid.mamba import MambaState

__all__ = ["StatePool", "state_bytes_per_sequence"]


def state_bytes_per_sequence(cfg: HybridConfig, dtype: torch.dtype) -> int:
    """Bytes of one sequence's state over all Mamba layers: conv windows in `dtype`, scan state fp32."""
    m = cfg.mamba
    if m is None:
        return 0
    itemsize = torch.empty((), dtype=dtype).element_size()
    conv = (m.inner_size + 2 * m.group_width) * (m.conv_kernel - 1) * itemsize
    ssm = m.num_heads * m.head_dim * m.state_size * 4
    return cfg.pattern.count("M") * (conv + ssm)


class StatePool:
    def __init__(self, model: nn.Module, slots: int, device: torch.device, dtype: torch.dtype):
        self.slots = slots
        self.scratch: int | None = None  # add_scratch_slot
        # Global layer number -> that Mamba layer's states of every slot.
        self.layers: dict[int, MambaState] = {
            int(name): block.mixer.new_state(slots, dtype, device)
            for name, block in model.layers.items() if block.symbol == "M"}

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for s in self.layers.values() for t in (*s.conv.values(), s.ssm))

    def gather(self, layer: int, slots: torch.Tensor, fresh: torch.Tensor | None,
               out: MambaState | None = None) -> MambaState:
        """Copies of `slots`' states of `layer` (a batch in slot order); zeros where `fresh` [b] (bool).
        With `out` (rows of `buffers`), the copies are written there and it is returned."""
        pool = self.layers[layer]
        if out is None:
            conv = {k: v.index_select(0, slots) for k, v in pool.conv.items()}
            ssm = pool.ssm.index_select(0, slots)
        else:
            conv = {k: torch.index_select(v, 0, slots, out=out.conv[k]) for k, v in pool.conv.items()}
            ssm = torch.index_select(pool.ssm, 0, slots, out=out.ssm)
        if fresh is not None:  # a broadcast mask, not t[fresh]: no host sync, so a CUDA graph can hold it
            for t in (*conv.values(), ssm):
                t.masked_fill_(fresh.view(-1, *(1,) * (t.dim() - 1)), 0)
        return MambaState(conv, ssm)

    def buffers(self, rows: int) -> dict[int, MambaState]:
        """Per Mamba layer, a state buffer of `rows` sequences (the pool's dtypes) for `gather(out=)`."""
        return {layer: MambaState({k: v.new_zeros(rows, *v.shape[1:]) for k, v in s.conv.items()},
                                  s.ssm.new_zeros(rows, *s.ssm.shape[1:]))
                for layer, s in self.layers.items()}

    def add_scratch_slot(self) -> int:
        """One slot more, past those the state manager hands out, for the padding rows of padded
        decode steps (cuda_graphs.py) to read and write; returns its index."""
        if self.scratch is None:
            for state in self.layers.values():
                state.conv = {k: torch.cat([v, torch.zeros_like(v[:1])]) for k, v in state.conv.items()}
                state.ssm = torch.cat([state.ssm, torch.zeros_like(state.ssm[:1])])
            self.scratch = self.slots  # `slots` stays the sequences' count
        return self.scratch

    def scatter(self, layer: int, slots: torch.Tensor, state: MambaState) -> None:
        pool = self.layers[layer]
        for k, v in pool.conv.items():
            v.index_copy_(0, slots, state.conv[k].to(v.dtype))
        pool.ssm.index_copy_(0, slots, state.ssm.float())
