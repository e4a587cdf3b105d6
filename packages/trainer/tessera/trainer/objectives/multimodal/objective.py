"""The vision-language objective under the parallel runtime (tessera.trainer.objectives.objective).

A batch (VisionLanguageBatch, labels) enters as: tokens into the first stage; the images as side
inputs cut by rows with them (pixels [rows, M, C, H, W] and each row's image count, so a row keeps
its images through micro-batches and data-parallel rows); labels [rows, T] as targets.

The first pipeline stage holds the vision tower, the projector and the text embedding (as
Megatron-Core's LLaVA puts the encoder on the first stage): it runs the tower on the micro-batch's
images and writes the projected features over the image tokens (VisionLanguageModel.embed), then
its share of the language model's blocks; later stages take hidden states, the last adds this
rank's vocabulary slice of the head. Positions are the whole sequence's (under sequence parallel a
stage sees T/tp rows); packed rows (`data.pack_samples`) bring each sample's positions and document
ids as side inputs, so attention stays within a sample on every stage. The loss is the vocab-parallel cross-entropy's mean over the counted
(answer) tokens of each micro-batch, averaged over micro-batches, as VisionLanguageStep computes on
one process.

Context parallel (C ranks share each row, `context_split`): the image features must be written over
the image tokens of the whole sequence, so every context rank embeds the whole rows (the tower runs
on all of the micro-batch's images on each: its weights are replicated over the context group like
every other, and their gradients, each rank's from its own tokens, are summed over it), then keeps
its two sequence chunks of the merged embeddings, as the runtime cuts a causal LM's tokens; labels,
positions and document ids are cut by the runtime. A micro-batch's mean answer loss divides each
rank's sum by the counted tokens of all its context ranks (one all-reduce of a count), since the
answers are not spread evenly over the chunks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tessera.common.parallel.context_parallel import ContextParallelAttention
from tessera.common.parallel.loss import vocab_parallel_cross_entropy
from tessera.common.parallel.tensor_parallel import parallel_logits
from tessera.trainer.objectives.documents import IGNORE_INDEX
from tessera.trainer.objectives.multimodal.batches import VisionLanguageBatch
from tessera.trainer.objectives.multimodal.loss import embed_for_training
from tessera.trainer.objectives.objective import LossContext


class VisionLanguage:
    pipeline = True

    def __init__(self, cfg=None) -> None:
        pass

    def split(self, batch: VisionLanguageBatch, labels: torch.Tensor, model_inputs: dict[str, torch.Tensor] | None):
        # Packed rows add each token's position in its sample and the sample's number in the row.
        return batch.tokens, {"pixels": batch.pixels, "num_images": batch.num_images, **batch.model_inputs()}, labels

    @staticmethod
    def context_split(cp, tokens: torch.Tensor, targets: torch.Tensor, inputs: dict[str, torch.Tensor]):
        """Context parallel: the whole rows' tokens and images stay (embedded whole, then cut in
        stage_forward); labels, positions and document ids are cut to this rank's chunks."""
        images = ("pixels", "num_images")
        return tokens, cp.split(targets), {k: v if k in images else cp.split(v) for k, v in inputs.items()}

    @staticmethod
    def images(pixels: torch.Tensor, num_images: torch.Tensor) -> torch.Tensor:
        """[rows, M, C, H, W] + counts -> the rows' images in reading order, [N, C, H, W]."""
        return VisionLanguageBatch(pixels.new_zeros(pixels.shape[:1]), pixels, num_images).images()

    @staticmethod
    def prepare_model(model):
        """The tower's blocks past `vision_feature_layer`, its post-LayerNorm and pooling head are
        never read (LLaVA takes an inner block's states): they stop requiring a gradient, so no
        optimizer decays or keeps state for them and `params_norm` leaves them out, on one process
        (model_setup.prepare_model) and under the runtime alike."""
        tower = model.vision
        unread = [tower.post_norm, tower.head, *(block for i, block in tower.layers.items()
                                                  if int(i) >= model.cfg.feature_layer_index)]
        for module in unread:
            if module is not None:
                module.requires_grad_(False)
        return model

    def stage_forward(self, stage, x: torch.Tensor, pixels: torch.Tensor | None = None,
                      num_images: torch.Tensor | None = None, positions: torch.Tensor | None = None,
                      document_ids: torch.Tensor | None = None) -> torch.Tensor:
        model = stage.model
        lm = model.language_model
        if stage.is_first:  # tokens in: text embeddings with the image features in place (the
            # tower runs on every micro-batch, images or not: embed_for_training says why)
            x = embed_for_training(model, x, self.images(pixels, num_images))
            if stage.cp is not None:
                x = stage.cp.split(x)
        positions = stage.positions if positions is None else positions
        if stage.cp is not None:  # causality by the local queries' global indices (positions restart per sample)
            attention = ContextParallelAttention(stage.cp, lm, stage.positions[0], stage.key_index, document_ids)
            h = lm(x, positions, return_hidden=True, attention_fn=attention)
        else:
            h = lm(x, positions, return_hidden=True, document_ids=document_ids)
        if not stage.is_last:
            return h
        weight = stage.tied_head if stage.tied_head is not None else lm.output_weight()
        return parallel_logits(h, weight, lm)

    def loss(self, logits: torch.Tensor, targets: torch.Tensor, ctx: LossContext) -> torch.Tensor:
        counted = targets != IGNORE_INDEX
        per_token = vocab_parallel_cross_entropy(logits, targets.masked_fill(~counted, 0), ctx.tp_group)
        count, share = counted.sum(), ctx.share
        if ctx.cp_group is not None:  # the micro-batch's answers over all its context ranks' chunks
            dist.all_reduce(count, group=ctx.cp_group)
            share //= dist.get_world_size(ctx.cp_group)
        return (per_token * counted).sum() / count.clamp(min=1) / share
