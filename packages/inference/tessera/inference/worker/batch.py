"""What one step's forward takes and gives: the scheduled sequences as the forward sees them
(`BatchSeq`), their packed tensors (`StepInputs`), and what executing the plan produced
(`ModelRunnerOutput`)."""

from __future__ import annotations

import operator
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from tessera.inference.core.image_inputs import ImageInput
from tessera.inference.core.scheduler import ScheduledSequence, SchedulerOutput
from tessera.inference.core.sequence import TokenLogprob
from tessera.inference.sample.sampler import DeferredRows, DeviceLogprobs
from tessera.inference.worker.decode_attention import DecodeSplit, SteadySplit


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


SAMPLING_FAILED = "internal error while sampling this request"


@dataclass
class LaunchedStep:
    """A step launched ahead (async scheduling, `ModelRunner.launch`): its sampled tokens on the
    device, where the next step's inputs read them; their copy on its way to the host; and the CUDA
    event recorded after that copy (None on CPU, where launching ran the step). With `deferred`
    rows (a grammar's, sampler.DeferredRows) the tokens are complete, and copied back, only after
    `finish_sampling`, which the engine calls once the step before is applied."""

    plan: SchedulerOutput
    sampled: list[int]  # the plan's rows that sampled, in order
    tokens: torch.Tensor  # int64 [len(sampled)]: their tokens
    host: torch.Tensor | None = None  # None: not copied back yet (rows deferred)
    logprobs: DeviceLogprobs | None = None  # on the host (or on its way), when a row asked
    ready: torch.cuda.Event | None = None
    deferred: DeferredRows | None = None  # rows whose sampling waits for their grammar masks
    failed: dict[str, str] = field(default_factory=dict)  # request id -> why its sampling failed

    @classmethod
    def start(cls, plan: SchedulerOutput, sampled: list[int], tokens: torch.Tensor,
              logprobs: DeviceLogprobs | None = None, deferred: DeferredRows | None = None) -> LaunchedStep:
        step = cls(plan, sampled, tokens, logprobs=logprobs, deferred=deferred)
        if deferred is None:
            step._copy_back()
        return step

    def _copy_back(self) -> None:
        """Start the tokens' (and logprobs') copy to the host; on CUDA through pinned memory, behind an event."""
        if self.tokens.device.type != "cuda":
            self.host = self.tokens
            return

        def to_host(t: torch.Tensor) -> torch.Tensor:
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            return host.copy_(t, non_blocking=True)
        self.host = to_host(self.tokens)
        self.logprobs = None if self.logprobs is None else self.logprobs.to_host(to_host)
        self.ready = torch.cuda.Event()
        self.ready.record()

    def finish_sampling(self) -> dict[str, Exception]:
        """Sample the deferred rows (their matchers advanced by the step before), completing `tokens`
        in place, and start the copy back. A row whose sampling failed fails its request (`output`
        reports it, as `ModelRunner.execute` does): returned as request id -> error. Raises what the
        sampler raised beyond one row's failure (then `fail_deferred`)."""
        assert self.deferred is not None and self.host is None
        rows = self.deferred.rows
        self.logprobs, failed = self.deferred.finish(self.tokens)
        self.deferred = None  # its logits are no longer held
        ids = {r: self.plan.scheduled[self.sampled[r]].seq.request_id for r in rows}
        self.failed.update({ids[r]: SAMPLING_FAILED for r in failed})
        self._copy_back()
        return {ids[r]: exc for r, exc in failed.items()}

    def fail_deferred(self) -> None:
        """Sampling the deferred rows raised as a whole: their requests fail, the others keep their
        tokens and logprobs (if those cannot be had either, the rows that asked for them fail too)."""
        deferred, self.deferred = self.deferred, None
        assert deferred is not None
        ids = [self.plan.scheduled[i].seq.request_id for i in self.sampled]
        self.failed.update({ids[r]: SAMPLING_FAILED for r in deferred.rows})
        try:
            with torch.inference_mode():
                self.logprobs = DeviceLogprobs.maybe(deferred.seqs, deferred.logits, self.tokens)
        except Exception:
            self.failed.update({rid: SAMPLING_FAILED for rid, seq in zip(ids, deferred.seqs)
                                if seq.params.logprobs is not None})
        self._copy_back()

    def output(self) -> ModelRunnerOutput:
        """Wait for the tokens on the host: what `ModelRunner.execute` would have returned for the plan."""
        assert self.host is not None, "a launched step's deferred rows were never sampled"
        if self.ready is not None:
            self.ready.synchronize()
        ids = [self.plan.scheduled[i].seq.request_id for i in self.sampled]
        tokens = self.host.tolist()
        out = ModelRunnerOutput(sampled=dict(zip(ids, [[t] for t in tokens])))
        if self.logprobs is not None:
            out.logprobs = {rid: [lp] for rid, lp in zip(ids, self.logprobs.rows(tokens)) if lp is not None}
        if self.failed:
            out.failed = dict(self.failed)
            for rid in self.failed:
                out.sampled.pop(rid, None)
                out.logprobs.pop(rid, None)
        return out


def host_to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`. To CUDA through pinned memory, without waiting: a copy from pageable
    memory waits for the device to finish its queued work, which async scheduling overlaps."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def copy_in(dst: torch.Tensor, src: torch.Tensor) -> None:
    """`dst.copy_(src)` from the host without waiting on CUDA (as `host_to_device`)."""
    if dst.device.type == "cuda" and src.device.type == "cpu":
        dst.copy_(src.pin_memory(), non_blocking=True)
    else:
        dst.copy_(src)


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

    def to(self, device: torch.device) -> StepInputs:
        """These inputs on `device` (a host-built step, `DecodeBatch`, for a CUDA forward: one copy each;
        its tokens may be there already: async scheduling's, sampled by the step before)."""
        if self.positions.device == device:
            return self
        return StepInputs(*(t if t is None or t.device == device else host_to_device(t, device) for t in (
            self.tokens, self.positions, self.slot_mapping, self.block_tables, self.seq_lens, self.query_start_loc,
            self.logits_rows)))


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


@dataclass
class DecodeUpdate:
    """What one steady decode step changes in a `DecodeBatch` (`plan_update`), which `apply` turns
    into the step's inputs: all a tensor-parallel worker is sent for such a step (`to_wire`), a few
    ints per sequence instead of its whole block table (vLLM v1 sends its workers a diff of the
    scheduler's output for the same reason)."""

    tokens: list[int]  # each row's input: its sequence's newest token
    starts: list[int]  # each row's position
    fresh: list[int]  # the rows entering a new block at this position
    fresh_blocks: list[int]  # their new table entries
    # None: the same rows as the last step, each one position on (the tables stay). Else per row the
    # last step's row it moves from, or -1 for a row written whole from `whole` (in order).
    src: list[int] | None = None
    whole: list[list[int]] = field(default_factory=list)

    def to_wire(self) -> list:
        return [self.tokens, self.starts, self.fresh, self.fresh_blocks, self.src, self.whole]

    @classmethod
    def from_wire(cls, wire: list) -> DecodeUpdate:
        return cls(*wire)


class DecodeBatch:
    """The inputs of steady decode steps (`SchedulerOutput.single_token`: each sequence computes its
    newest token alone), kept across steps as vLLM v1's persistent input batch keeps them: one row
    per sequence in the step's order, its block table a row of a host tensor (the step's inputs are
    built on the host, then copied to the device once each or into the CUDA graphs' static buffers).
    From one such step to the next the same sequences only advance by one position, so a step writes
    a table entry only where a sequence entered a new block; a row is rebuilt from the plan only when
    its sequence is new to the batch or did not advance by exactly one (a failed step, a step between
    that was not a decode step). Any other plan (prefills, drafts) goes through `prepare` and empties
    the batch; so does a preemption (`SchedulerOutput.epoch`): a sequence's table changes only then
    or there.

    Two halves: `plan_update` (which rows stay, what they need: from the plan and the rows of the
    last step) and `apply` (the tables and the step's tensors). One device calls both (`inputs`);
    under tensor parallel the driver plans the update and each worker applies it to its own copy."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.seqs: list = []  # the rows' sequences (the last step's plan)
        self.next_start: list[int] = []  # the position each row computes next if it advances by one
        self.epoch = -1
        self.tables = np.zeros((0, 0), dtype=np.int32)  # numpy: host-side writes cost far less than torch ops
        self.split: SteadySplit | None = None  # the CPU decode grouping of these rows, kept while they are steady

    def clear(self) -> None:
        self.seqs, self.next_start, self.split = [], [], None

    def inputs(self, plan: SchedulerOutput, split: bool) -> StepInputs:
        """The step's inputs on the host (every row's logits: each samples); `split`: with the CPU
        decode grouping."""
        return self.apply(self.plan_update(plan), split)

    def plan_update(self, plan: SchedulerOutput) -> DecodeUpdate:
        """The step's change to the batch; from here on the batch's rows are the plan's."""
        sched = plan.scheduled
        bs = self.block_size
        seqs = [s.seq for s in sched]
        starts = [s.start for s in sched]
        steady = (plan.epoch == self.epoch and len(seqs) == len(self.seqs) and starts == self.next_start
                  and all(map(operator.is_, seqs, self.seqs)))
        src, whole = None, []
        if not steady:
            # A row kept from the last step (same sequence, one position on, no preemption since)
            # moves by one gather; any other is written whole from its block table.
            kept = {id(seq): (r, p) for r, (seq, p) in enumerate(zip(self.seqs, self.next_start))} \
                if plan.epoch == self.epoch else {}
            src = []
            for i, (seq, p) in enumerate(zip(seqs, starts)):
                r, expected = kept.get(id(seq), (-1, -1))
                if expected == p and self.seqs[r] is seq:
                    src.append(r)
                else:
                    src.append(-1)
                    whole.append(sched[i].block_table)
        # One position on, a row needs a new table entry only where it enters a new block.
        fresh = [i for i, p in enumerate(starts) if p % bs == 0]
        self.seqs, self.epoch = seqs, plan.epoch
        self.next_start = [p + 1 for p in starts]
        return DecodeUpdate([(s.output_ids or s.prompt_ids)[-1] for s in seqs], starts, fresh,
                            [sched[i].block_table[starts[i] // bs] for i in fresh], src, whole)

    def apply(self, update: DecodeUpdate, split: bool) -> StepInputs:
        """The step's inputs on the host, the tables brought up to `update`."""
        starts, fresh = update.starts, update.fresh
        n, bs = len(starts), self.block_size
        blocks_needed = max(starts) // bs + 1
        rows, cols = self.tables.shape
        if blocks_needed > cols or n > rows:
            grown = np.zeros((max(n, rows), max(blocks_needed, 2 * cols)), dtype=np.int32)
            grown[:rows, :cols] = self.tables
            self.tables = grown
        if update.src is not None:
            self._rebuild(update.src, update.whole)
        if fresh:
            self.tables[fresh, [starts[i] // bs for i in fresh]] = update.fresh_blocks
        pos = np.array(starts, dtype=np.int64)
        slots = self.tables[np.arange(n), pos // bs].astype(np.int64) * bs + pos % bs
        ids = torch.tensor([update.tokens, starts], dtype=torch.long)
        lens = [p + 1 for p in starts]
        inputs = StepInputs(
            tokens=ids[0:1], positions=ids[1:2], slot_mapping=torch.from_numpy(slots),
            block_tables=torch.from_numpy(np.ascontiguousarray(self.tables[:n, :blocks_needed])),
            seq_lens=torch.tensor(lens, dtype=torch.int32), query_start_loc=torch.arange(n + 1, dtype=torch.int32),
            logits_rows=None)
        if not split:
            self.split = None  # not advanced this step: rebuilt when next asked for
        elif update.src is None and self.split is not None:
            inputs.split = self.split.step(fresh, self.tables)
        else:
            self.split = SteadySplit(lens, self.tables, bs)
            inputs.split = self.split.split
        return inputs

    def _rebuild(self, src: list[int], whole: list[list[int]]) -> None:
        """Rows in the update's order: row i moves from the last step's row src[i], or (-1) is written
        from the next of `whole`."""
        tables = self.tables[[max(r, 0) for r in src]]
        width = tables.shape[1]
        rows = iter(whole)
        for i, r in enumerate(src):
            if r < 0:
                row = next(rows)[:width]
                tables[i, :len(row)] = row
                tables[i, len(row):] = 0
        self.tables[:len(src)] = tables


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
