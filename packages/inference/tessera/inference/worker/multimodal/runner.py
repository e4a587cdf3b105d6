"""The vision-language kind's model runner: the causal LM's paged runner over the language model,
with the image features written over the image tokens' embeddings.

At a step whose prefill chunks hold image tokens, the images of every such request not yet
encoded go through the vision tower and projector in one batch; a request's features are kept
(by request id) until its prefill passes its last image token, so each chunk that holds some of
its image tokens finds them, and are dropped then. After a preemption the features are computed
again like the K/V. Under tensor parallel every worker runs this runner over its shard, the step's
images (already processed pixels) coming with their sequences (BatchSeq.images; executor.py sends
them). Kept features are bounded (`MAX_KEPT`, oldest dropped first: a dropped entry
is only recomputed), so a request aborted mid-prefill leaks nothing. Decode steps and text-only
steps run the base runner unchanged.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from tessera.inference.worker.batch import BatchSeq, StepInputs
from tessera.inference.worker.model_runner import undivided
from tessera.inference.worker.pooling.runner import DecoderRunner

MAX_KEPT = 256  # requests whose image features are kept between prefill chunks


def tensor_parallel_problem(tp: int, cfg) -> str | None:
    """Why `cfg` cannot be served split over `tp` ranks (a phrase), or None. The kind's plan
    (vision_language/parallelize.py) splits the tower's heads and MLP, the projector by the
    language model's width, and the language model as the causal LM's; key/value heads are never
    replicated here (the worker builds the kind's own model)."""
    v, t = cfg.vision, cfg.text
    dense = t.moe is None or any(not t.moe.is_moe_layer(i) for i in range(t.num_layers))
    counts = [("vision attention heads (vision.num_heads)", v.num_heads),
              ("vision MLP width (vision.ffn_hidden_size)", v.ffn_hidden_size),
              ("attention heads", t.num_heads), ("key/value heads", t.kv_heads),
              ("language model width (the projector's)", t.hidden_size), ("vocabulary rows", t.vocab_rows),
              ("MLP width", t.ffn_hidden_size if dense else None)]  # MoE experts are replicated
    return undivided(tp, counts)


class VisionLanguageRunner(DecoderRunner):
    # Steps with images feed embeddings, not token ids, to the layer stack, which the CPU-compiled
    # forward does not take.
    eager_reason = "a vision-language model's prefill writes image features over token embeddings"
    # Under tensor parallel each worker runs this runner over its shard: the step's images come with
    # their sequences (BatchSeq.images), every rank encodes them (the tower's split layers all-reduce).
    tensor_parallel_problem = staticmethod(tensor_parallel_problem)

    @staticmethod
    def block_bytes(cfg, block_size: int, dtype: torch.dtype, tp: int = 1) -> int:
        return DecoderRunner.block_bytes(cfg.text, block_size, dtype, tp)

    @staticmethod
    def hidden_size(cfg) -> int:
        """The width of the hidden states it pools: the language model's."""
        return cfg.text.hidden_size

    def __init__(self, model, num_blocks: int, block_size: int, device: torch.device, dtype: torch.dtype,
                 tp_rank: int = 0, tp_size: int = 1, kv_dtype: torch.dtype | None = None):
        super().__init__(model.language_model, num_blocks, block_size, device, dtype, tp_rank, tp_size,
                         kv_dtype=kv_dtype)
        self.vlm = model
        self.image_token_id = model.cfg.image_token_id
        self.features: OrderedDict[str, torch.Tensor] = OrderedDict()  # request id -> [images, length, d]
        self._embeds: torch.Tensor | None = None  # this step's input embeddings, while it has images

    def forward_batch(self, batch: list[BatchSeq], logits_rows: list[int]) -> torch.Tensor:
        with_images = [(row, s) for row, s in zip(_row_starts(batch), batch) if s.images]
        if not with_images:
            return super().forward_batch(batch, logits_rows)
        step = self.prepare(batch, logits_rows)
        self._encode([s for _, s in with_images])
        self._embeds = self._embed(step, with_images)
        try:
            return self._logits(step).float()
        finally:
            self._embeds = None
            for _, s in with_images:
                if s.start + s.num_new >= s.images[-1].end:
                    self.features.pop(s.request_id, None)  # its prefill is past its images

    # A step without images (every decode step: an image's tokens are all in its prompt) is the
    # language model's own, so steady decode steps take their inputs from the persistent batch.
    forward_batch.same_single_token_forward = True  # type: ignore[attr-defined]

    def _encode(self, scheduled: list[BatchSeq]) -> None:
        """The features of every request here not kept yet, its images in one batch with the others'."""
        todo = [s for s in scheduled if s.request_id not in self.features]
        if not todo:
            return
        pixels = torch.stack([im.tensor() for s in todo for im in s.images])
        features = self.vlm.image_features(pixels.to(self.device))  # the tower casts to its own dtype
        at = 0
        for s in todo:
            n = len(s.images)
            self.features[s.request_id] = features[at:at + n]
            at += n
        while len(self.features) > MAX_KEPT:
            self.features.popitem(last=False)

    def _embed(self, step: StepInputs, with_images: list[tuple[int, BatchSeq]]) -> torch.Tensor:
        """Token embeddings [1, T, d] of the step, image features over its image tokens."""
        tokens = step.tokens
        embed = self.model.embed_tokens
        h = embed(tokens.masked_fill(tokens == self.image_token_id, 0))
        for row, s in with_images:
            feats = self.features[s.request_id]
            end = s.start + s.num_new
            for j, im in enumerate(s.images):
                lo, hi = max(im.offset, s.start), min(im.end, end)
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

    _hidden.same_single_token_forward = True  # type: ignore[attr-defined]  # `_embeds` is set only with images


def _row_starts(batch: list[BatchSeq]) -> list[int]:
    starts, at = [], 0
    for s in batch:
        starts.append(at)
        at += s.num_new
    return starts
