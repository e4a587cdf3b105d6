"""The multi-token-prediction depths of a DeepSeek-V3 model run as a speculative draft: a latent
runner over the target's own MTP modules (shared weights, already in their serving form), with a
latent cache of one layer per depth (the MTP block's attention sees the depth's own earlier
positions) in blocks of its own (spec_decode/proposers.py hands them out)."""

from __future__ import annotations

from functools import partial

import torch

from tessera.inference.worker.batch import BatchSeq
from tessera.inference.worker.latent.runner import LatentRunner


class MTPRunner(LatentRunner):
    @staticmethod
    def cache_layers(cfg) -> int:
        return cfg.mtp.depth

    def _layer_latent(self, layer: int):
        return super()._layer_latent(layer - self.cfg.num_layers)  # the MTP blocks are layers num_layers + depth

    @torch.inference_mode()
    def draft(self, depth: int, batch: list[BatchSeq], hidden: torch.Tensor,
              logits_rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Depth `depth` over the packed rows: position p of a sequence reads the previous hidden
        state at p (hidden [T, d]) and the token at p + 1 (the BatchSeq's tokens). Returns fp32
        logits of `logits_rows` (each predicts the token at p + 2) and the depth's hidden [T, d]."""
        step = self.prepare(batch, logits_rows)
        attention = partial(self._attention, step)
        out = self.model.mtp_hidden(depth, hidden[None].to(self.model.output_weight().dtype), step.tokens,
                                    step.positions, attention)[0]
        rows = out.index_select(0, step.logits_rows)
        return self.model.logits(rows, self.model.output_weight()).float(), out
