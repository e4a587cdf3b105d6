"""The vision-language objective under the parallel runtime (tessera.trainer.parallel.objective).

A batch (VisionLanguageBatch, labels) enters as: tokens into the first stage; the images as side
inputs cut by rows with them (pixels [rows, M, C, H, W] and each row's image count), which only a
stage holding the tower and the embeddings reads (it runs the tower and writes the features over
the image tokens; later stages take hidden states); labels [rows, T] as targets. The loss is the
vocab-parallel cross-entropy's mean over the counted (answer) tokens of each micro-batch, averaged
over micro-batches, as VisionLanguageStep computes on one process.
"""

from __future__ import annotations

import torch

from tessera.common.parallel.loss import vocab_parallel_cross_entropy
from tessera.trainer.multimodal.batches import VisionLanguageBatch
from tessera.trainer.objectives.documents import IGNORE_INDEX
from tessera.trainer.parallel.objective import LossContext


class VisionLanguage:
    pipeline = True
    # No stage_forward yet runs the tower on the images: a stage would meet image tokens without them.
    parallel_problem = "the parallel runtime's stages do not run the vision tower on the images"

    def __init__(self, cfg=None) -> None:
        pass

    def split(self, batch: VisionLanguageBatch, labels: torch.Tensor, model_inputs: dict[str, torch.Tensor] | None):
        return batch.tokens, {"pixels": batch.pixels, "num_images": batch.num_images}, labels

    @staticmethod
    def images(pixels: torch.Tensor, num_images: torch.Tensor) -> torch.Tensor:
        """[rows, M, C, H, W] + counts -> the rows' images in reading order, [N, C, H, W]."""
        return VisionLanguageBatch(pixels.new_zeros(pixels.shape[:1]), pixels, num_images).images()

    def loss(self, logits: torch.Tensor, targets: torch.Tensor, ctx: LossContext) -> torch.Tensor:
        counted = targets != IGNORE_INDEX
        per_token = vocab_parallel_cross_entropy(logits, targets.masked_fill(~counted, 0), ctx.tp_group)
        return (per_token * counted).sum() / counted.sum().clamp(min=1) / ctx.share
