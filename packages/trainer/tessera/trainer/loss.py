"""The training loss: mean next-token cross-entropy, a function of the output and the labels.

Kept apart from the model so a parallel layout can substitute a vocab-parallel version, and so
the model can hand over hidden states instead of logits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def cross_entropy_loss(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Mean cross-entropy over all label positions; logits [B, T, V] in any dtype, computed in fp32."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=ignore_index)
