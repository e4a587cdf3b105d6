"""Dropout RNG across tensor-parallel ranks (the idea of Megatron's CUDA RNG tracker).

Outside tensor-parallel regions activations are replicated across tensor ranks, so their
dropout masks must be identical: the default generator is seeded the same on every tensor rank
(and differently per pipeline stage). Inside a region each rank holds different heads or
sequence chunks, so masks must differ: `tracker.fork()` swaps in a second generator seeded per
tensor rank, and swaps the default back afterwards, leaving its stream untouched.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

# Offset between the default and the tensor-parallel seed streams (any fixed constant works).
_TP_SEED_OFFSET = 2718


class TensorParallelRNG:
    """Holds the tensor-parallel generator state of this rank."""

    def __init__(self, seed: int, tp_rank: int, pp_rank: int, device: torch.device):
        self.device = device
        self.default_seed = seed + 100 * pp_rank
        self.tp_seed = seed + _TP_SEED_OFFSET + 100 * pp_rank + tp_rank
        gen = torch.Generator(device=device)
        gen.manual_seed(self.tp_seed)
        self._state = gen.get_state()

    def seed_default(self) -> None:
        """Seed the default generator identically on all tensor ranks of a pipeline stage."""
        torch.manual_seed(self.default_seed)

    def _get(self) -> torch.Tensor:
        return torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else torch.get_rng_state()

    def _set(self, state: torch.Tensor) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_rng_state(state, self.device)
        else:
            torch.set_rng_state(state)

    @contextlib.contextmanager
    def fork(self) -> Iterator[None]:
        saved = self._get()
        self._set(self._state)
        try:
            yield
        finally:
            self._state = self._get()
            self._set(saved)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"tp_rng_state": self._state.clone()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self._state = state["tp_rng_state"].clone()
