"""The vision-language step (`train_loss = "vision_language"`): the model's logits (image features
written over the image tokens) against the answer tokens' labels, their mean per micro-batch,
micro-batch means averaged (as the masked-LM step: rows hold different numbers of answer tokens).
Forward, backward, clipping and the optimizer step are TrainStep's; only the loss differs.
"""

from __future__ import annotations

import torch
from torch import nn

from tessera.common.errors import UserError
from tessera.trainer.components.precision.mixed import Precision
from tessera.trainer.objectives.documents import DocumentMasking
from tessera.trainer.objectives.loss import cross_entropy_loss
from tessera.trainer.objectives.multimodal.batches import VisionLanguageBatch
from tessera.trainer.objectives.step import TrainStep


def embed_for_training(model: nn.Module, tokens: torch.Tensor, images: torch.Tensor) -> torch.Tensor:
    """The model's embeddings with the images' features in place (VisionLanguageModel.embed), and
    for a micro-batch without images the tower and projector run anyway, on one zero image whose
    features enter as `0 * features.sum()`: the values are those of the text alone, and every
    trained tower and projector weight gets a (zero) gradient on every micro-batch. So a data or
    fully-sharded rank whose rows carry no image issues the same FSDP all-gathers and completes the
    same gradient buckets as one whose rows do, and a stage-1 run (only the projector trains) has a
    loss to backpropagate. One process takes the same path, so its steps are the runtime's (AdamW
    sees a zero gradient, not none, on a step without images, as the flat-buffer optimizers do)."""
    if images.shape[0]:
        return model.embed(tokens, images)
    h = model.embed(tokens, None)
    vision = model.cfg.vision
    zero = images.new_zeros(1, vision.num_channels, vision.image_size, vision.image_size)
    return h + 0 * model.image_features(zero).to(h.dtype).sum()


def vision_language_loss(model: nn.Module, inputs: VisionLanguageBatch, labels: torch.Tensor,
                         reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy over the counted (answer) labels of the model's logits for the batch (packed
    rows: each sample with its own positions and attention, `inputs.model_inputs()`)."""
    extra = inputs.model_inputs()
    h = embed_for_training(model, inputs.tokens, inputs.images())
    logits = model.language_model(h, extra.get("positions"), document_ids=extra.get("document_ids"))
    return cross_entropy_loss(logits, labels, reduction=reduction)


class VisionLanguageStep(TrainStep):
    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, precision: Precision, grad_clip: float,
                 loss_chunk_tokens: int | None = None, compile: bool = False,
                 documents: DocumentMasking | None = None):
        if loss_chunk_tokens is not None:
            raise UserError("training.loss_chunk_tokens is not built for vision-language runs: set it to null")
        if compile:
            raise UserError("training.compile is not built for vision-language runs (a batch's image count varies, "
                            "so every step would recompile): set it to false")
        super().__init__(model, optimizer, precision, grad_clip, None, False, None)

    def loss(self, inputs: VisionLanguageBatch, labels: torch.Tensor, reduction: str = "mean") -> torch.Tensor:  # type: ignore[override]
        with self.precision.autocast():
            return vision_language_loss(self.model, inputs, labels, reduction)
