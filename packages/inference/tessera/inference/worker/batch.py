"""What one step's forward takes and gives: the scheduled sequences as the forward sees them
(`BatchSeq`), their packed tensors (`StepInputs`), and what executing the plan produced
(`ModelRunnerOutput`)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from tessera.inference.core.image_inputs import ImageInput
from tessera.inference.core.scheduler import ScheduledSequence, SchedulerOutput
from tessera.inference.core.sequence import TokenLogprob
from tessera.inference.worker.decode_attention import DecodeSplit


@dataclass
class ModelRunnerOutput:
    """What one executed plan produced, by request id."""

    # The new tokens of each sequence that sampled: one, or with speculation the accepted drafts
    # and one more.
    sampled: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)  # for those that asked, per token
    prompt_logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)  # new prompt positions
    failed: dict[str, str] = field(default_factory=dict)  # request id -> why its computation failed
    pooled: dict[str, list[float]] = field(default_factory=dict)  # embeddings: the pooled hidden state

    def update(self, other: ModelRunnerOutput) -> None:
        for mine, theirs in ((self.sampled, other.sampled), (self.logprobs, other.logprobs),
                             (self.prompt_logprobs, other.prompt_logprobs), (self.failed, other.failed),
                             (self.pooled, other.pooled)):
            mine.update(theirs)


@dataclass
class StepInputs:
    tokens: torch.Tensor  # [1, T]
    positions: torch.Tensor  # [1, T]
    slot_mapping: torch.Tensor  # [T] flat slot of each new token in the pool
    block_tables: torch.Tensor  # int32 [S, max_blocks]
    seq_lens: torch.Tensor  # int32 [S]
    query_start_loc: torch.Tensor  # int32 [S + 1]
    logits_rows: torch.Tensor | None  # [R] rows of the packed batch that go through the head (None: all)
    split: DecodeSplit | None = None  # CPU only, when the step has a decode row


@dataclass
class BatchSeq:
    """What the forward needs of one scheduled sequence (all a tensor-parallel worker is sent):
    its new tokens, the position of the first, its block table, and `num_q`: its new tokens when
    it decodes (1, or 1 + k drafts), 0 for a prefill chunk; `state_slot`: its slot in the state
    pool of a hybrid model (-1: none); `prompt_len`: its prompt's length (an encoder-decoder's
    runner tells the encoder input from the decoder tokens by it); `images`: all of its images when
    this chunk holds some of their tokens, else none (a vision-language runner encodes them, keeping
    the features under `request_id` between chunks)."""

    tokens: list[int]
    start: int
    block_table: list[int]
    num_q: int
    state_slot: int = -1
    prompt_len: int = 0
    request_id: str = ""
    images: tuple[ImageInput, ...] = ()

    @property
    def num_new(self) -> int:
        return len(self.tokens)


def batch_seqs(plan: SchedulerOutput) -> list[BatchSeq]:
    out = []
    for s in plan.scheduled:
        seq = s.seq
        images = _chunk_images(s) if seq.params.images else ()
        if s.num_new == 1 and seq.output_ids and s.start == seq.num_tokens - 1:  # a decode row: its newest token
            out.append(BatchSeq([seq.output_ids[-1]], s.start, s.block_table, 1, s.state_slot, len(seq.prompt_ids),
                                seq.request_id, images))
        else:
            out.append(BatchSeq(s.tokens(), s.start, s.block_table, s.num_new if s.num_new == 1 or s.spec_token_ids
                                else 0, s.state_slot, len(seq.prompt_ids), seq.request_id, images))
    return out


def _chunk_images(s: ScheduledSequence) -> tuple[ImageInput, ...]:
    images = s.seq.params.images
    return tuple(images) if any(im.offset < s.end and im.end > s.start for im in images) else ()


def images_to_wire(batch: list[BatchSeq]) -> list:
    """The images of a step's sequences as a tensor-parallel worker is sent them (JSON: pixels in
    base64, as the engine pipe carries them): [index in batch, request id, images] where any."""
    return [[i, s.request_id, [im.model_dump() for im in s.images]] for i, s in enumerate(batch) if s.images]


def with_wire_images(batch: list[BatchSeq], wire: list | None) -> list[BatchSeq]:
    """`batch` with the images `images_to_wire` sent put back (checked against their hashes again)."""
    for i, request_id, images in wire or ():
        batch[i] = replace(batch[i], request_id=request_id,
                           images=tuple(ImageInput.model_validate(im) for im in images))
    return batch


def right_padded(rows: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token rows as one right-padded [N, longest] id tensor (0 where padding) and its bool mask of
    real positions, on `device` (the encoder runners' padded batches)."""
    longest = max(len(row) for row in rows)
    ids = torch.zeros(len(rows), longest, dtype=torch.long)
    mask = torch.zeros(len(rows), longest, dtype=torch.bool)
    for i, row in enumerate(rows):
        ids[i, :len(row)] = torch.tensor(row)
        mask[i, :len(row)] = True
    return ids.to(device), mask.to(device)
