"""The vision-language kind's model runner: the causal LM's paged runner over the language model,
with the image features written over the image tokens' embeddings.

At a step whose prefill chunks hold image tokens, the images of every such request not yet
encoded go through the vision tower and projector in one batch; a request's features are kept
(by request id) until its prefill passes its last image token, so each chunk that holds some of
its image tokens finds them, and are dropped then. After a preemption the features are computed
again like the K/V. Kept features are bounded (`MAX_KEPT`, oldest dropped first: a dropped entry
is only recomputed), so a request aborted mid-prefill leaks nothing. Decode steps and text-only
steps run the base runner unchanged.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from tessera.inference.core.scheduler import ScheduledSequence, SchedulerOutput
from tessera.inference.pooling.runner import DecoderRunner
from tessera.inference.worker.batch import StepInputs, batch_seqs

MAX_KEPT = 256  # requests whose image features are kept between prefill chunks


class VisionLanguageRunner(DecoderRunner):
    # Steps with images feed embeddings, not token ids, to the layer stack, which the CPU-compiled
    # forward does not take.
    eager_reason = "a vision-language model's prefill writes image features over token embeddings"
    # The kind has a training plan (vision_language/parallelize.py), but no TP worker path carries a
    # step's images to the ranks yet.
    no_tensor_parallel = ("a vision-language model is served on one process (the tensor-parallel workers do "
                          "not receive a step's images yet)")

    @staticmethod
    def block_bytes(cfg, block_size: int, dtype: torch.dtype, tp: int = 1) -> int:
        return DecoderRunner.block_bytes(cfg.text, block_size, dtype, tp)

    def __init__(self, model, num_blocks: int, block_size: int, device: torch.device, dtype: torch.dtype,
                 tp_rank: int = 0, tp_size: int = 1, kv_dtype: torch.dtype | None = None):
        super().__init__(model.language_model, num_blocks, block_size, device, dtype, tp_rank, tp_size,
                         kv_dtype=kv_dtype)
        self.vlm = model
        self.image_token_id = model.cfg.image_token_id
        self.features: OrderedDict[str, torch.Tensor] = OrderedDict()  # request id -> [images, length, d]
        self._embeds: torch.Tensor | None = None  # this step's input embeddings, while it has images

    def forward(self, plan: SchedulerOutput, logits_rows: list[int]) -> torch.Tensor:
        with_images = [(row, s) for row, s in zip(_row_starts(plan), plan.scheduled)
                       if any(im.offset < s.end and im.end > s.start for im in s.seq.params.images)]
        if not with_images:
            return super().forward(plan, logits_rows)
        batch = batch_seqs(plan)
        step = self.prepare(batch, logits_rows)
        self._encode([s for _, s in with_images])
        self._embeds = self._embed(step, with_images)
        try:
            return self._logits(step).float()
        finally:
            self._embeds = None
            for _, s in with_images:
                if s.end >= s.seq.params.images[-1].end:
                    self.features.pop(s.seq.request_id, None)  # its prefill is past its images

    def _encode(self, scheduled: list[ScheduledSequence]) -> None:
        """The features of every request here not kept yet, its images in one batch with the others'."""
        todo = [s.seq for s in scheduled if s.seq.request_id not in self.features]
        if not todo:
            return
        pixels = torch.stack([im.tensor() for seq in todo for im in seq.params.images])
        features = self.vlm.image_features(pixels.to(self.device))  # the tower casts to its own dtype
        at = 0
        for seq in todo:
            n = len(seq.params.images)
            self.features[seq.request_id] = features[at:at + n]
            at += n
        while len(self.features) > MAX_KEPT:
            self.features.popitem(last=False)

    def _embed(self, step: StepInputs, with_images: list[tuple[int, ScheduledSequence]]) -> torch.Tensor:
        """Token embeddings [1, T, d] of the step, image features over its image tokens."""
        tokens = step.tokens
        embed = self.model.embed_tokens
        h = embed(tokens.masked_fill(tokens == self.image_token_id, 0))
        for row, s in with_images:
            feats = self.features[s.seq.request_id]
            for j, im in enumerate(s.seq.params.images):
                lo, hi = max(im.offset, s.start), min(im.end, s.end)
                if lo < hi:
                    h[0, row + lo - s.start:row + hi - s.start] = feats[j, lo - im.offset:hi - im.offset].to(h.dtype)
        return h

    def _hidden(self, step: StepInputs) -> torch.Tensor:
        if self._embeds is None:
            return super()._hidden(step)
        from functools import partial

        hidden = self.model(self._embeds, positions=step.positions, attention_fn=partial(self._attention, step),
                            return_hidden=True)
        return self._pool_hidden(hidden)


def _row_starts(plan: SchedulerOutput) -> list[int]:
    starts, at = [], 0
    for s in plan.scheduled:
        starts.append(at)
        at += s.num_new
    return starts
