"""Iteration-level (continuous) batching: which sequences run in the next step, and how many
of their tokens.

Each step has a token budget. Running sequences go first, in arrival order: a decoding one takes
one token, one still in prefill takes the next chunk of its prompt (chunked prefill), as the
budget allows. If the pool cannot hold a running sequence's next tokens, the newest running
sequence is preempted by recompute (its blocks are freed, it goes back to the head of the queue
and later re-prefills prompt + output so far) until the older one fits. Waiting requests are
then admitted first-come first-served while budget, sequence slots and blocks last, starting
past any prefix already in the prefix cache. Nothing is admitted in a step that preempted,
which keeps a short pool from thrashing. A request whose first chunk must be whole (an
encoder-decoder's encoder input: `BlockManager.first_chunk`) waits for a step with room for it, or
alone takes a step past the budget rather than wait forever.

A decoding sequence that carries draft tokens (speculative decoding, spec_decode/proposers.py) computes its
newest token plus the drafts in one row, 1 + k tokens, so that the model runner can verify them;
the drafts are cut to what the budget leaves after one token for each later running sequence, and
dropped (the sequence decodes one token) when the pool cannot hold them.

`schedule` returns a plan (`SchedulerOutput`): for each scheduled sequence the token range it
computes this step (a prefill chunk, one decode token, or a decode token and its drafts) and its
block table. The model runner executes the plan without touching any sequence;
`output_processor.OutputProcessor` then applies the results (vLLM v1's schedule -> execute ->
update).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tessera.inference.core.block_manager import BlockManager
from tessera.inference.core.sequence import Sequence, Status


@dataclass
class ScheduledSequence:
    seq: Sequence
    start: int  # first position computed this step (tokens before it are in the cache)
    num_new: int  # tokens computed this step: positions [start, start + num_new)
    block_table: list[int]  # its blocks (a copy of the block manager's table), covering start + num_new
    # Draft tokens computed after the sequence's newest token (positions seq.num_tokens onwards),
    # verified by this step, and the draft distributions they came from (None: a point mass).
    spec_token_ids: list[int] = field(default_factory=list)
    spec_probs: torch.Tensor | None = None
    state_slot: int = -1  # its slot in the per-sequence state pool (hybrid models), -1: none

    @property
    def end(self) -> int:
        return self.start + self.num_new

    @property
    def completes_prompt(self) -> bool:
        """True when this step reaches the last known token: the step then samples the next one."""
        return self.end == self.seq.num_tokens + len(self.spec_token_ids)

    def tokens(self) -> list[int]:
        """The token ids this step computes: known tokens, then drafts."""
        known = self.seq.num_tokens
        out = self.seq.tokens(self.start, min(self.end, known)) if self.start < known else []
        first = max(self.start, known) - known
        return out + self.spec_token_ids[first:first + max(0, self.end - max(self.start, known))]


@dataclass
class SchedulerOutput:
    """One step's plan, in batch order."""

    scheduled: list[ScheduledSequence]
    # Every sequence computes just its newest token (one row each, no drafts) and samples the next:
    # the steady decode step, whose inputs the model runner updates in place (batch.DecodeBatch).
    single_token: bool = False
    # The scheduler's preemption count when planned: a change tells the runner's kept rows that a
    # sequence may have been preempted and readmitted with another block table since.
    epoch: int = 0

    @property
    def seqs(self) -> list[Sequence]:
        return [s.seq for s in self.scheduled]

    @property
    def num_new(self) -> list[int]:
        return [s.num_new for s in self.scheduled]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new for s in self.scheduled)

    @property
    def decodes(self) -> list[ScheduledSequence]:
        """Sequences computing just their newest token (one generated after the prompt), with
        any draft tokens after it."""
        return [s for s in self.scheduled if s.num_new == 1 + len(s.spec_token_ids) and s.start >= len(s.seq.prompt_ids)]

    @property
    def prefills(self) -> list[ScheduledSequence]:
        """Sequences computing a chunk of their prompt (or of prompt + output after a preemption)."""
        decodes = {id(s) for s in self.decodes}
        return [s for s in self.scheduled if id(s) not in decodes]

    def only(self, i: int) -> SchedulerOutput:
        """The plan for the i-th sequence alone (to find which request of a failed step fails)."""
        return SchedulerOutput([self.scheduled[i]], self.single_token, self.epoch)


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_batched_tokens: int, max_num_seqs: int):
        self.blocks = blocks
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, seq: Sequence) -> None:
        self.blocks.free_seq(seq)
        seq.spec_token_ids, seq.spec_probs = [], None
        seq.num_computed = 0
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        seqs: list[Sequence] = []
        num_new: list[int] = []
        drafts: dict[int, int] = {}  # index in seqs -> drafts scheduled
        preempted = False
        single = True  # every row is a sequence's newest token alone, which it samples after
        # Most running sequences' blocks already hold their next token: checked here, without a call,
        # when allocation is the plain block manager's (a state pool's allocate does more).
        tables, bs = self.blocks.tables, self.blocks.block_size
        plain_allocate = type(self.blocks).allocate is BlockManager.allocate
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            left = len(seq.prompt_ids) + len(seq.output_ids) - seq.num_computed
            n = min(left, budget)
            if left != 1 or not seq.output_ids and seq.params.max_tokens <= 0:
                single = False
            if n == 1 and seq.spec_token_ids:
                # Keep one token of budget for each running sequence after this one.
                k = max(0, min(len(seq.spec_token_ids), budget - len(self.running) + i))
                if k and self.blocks.allocate(seq, seq.num_computed + 1 + k):
                    drafts[len(seqs)] = k
                    n = 1 + k
                    single = False
            if not (plain_allocate and len(tables.get(seq.request_id, ())) * bs >= seq.num_computed + n):
                while not self.blocks.allocate(seq, seq.num_computed + n):
                    victim = self.running.pop()
                    self._preempt(victim)
                    preempted = True
                    if victim is seq:
                        break
                if seq.status is not Status.RUNNING:
                    break  # it preempted itself: everything after it is gone too
            seqs.append(seq)
            num_new.append(n)
            budget -= n
            i += 1
        if not preempted:
            budget, single = self._admit(seqs, num_new, budget, single)
        table = self.blocks.table
        if type(self.blocks).state_slot is BlockManager.state_slot:  # no state pool: no slot to look up
            plan = [ScheduledSequence(seq, seq.num_computed, n, list(table(seq))) for seq, n in zip(seqs, num_new)]
        else:
            plan = [ScheduledSequence(seq, seq.num_computed, n, list(table(seq)), state_slot=self.blocks.state_slot(seq))
                    for seq, n in zip(seqs, num_new)]
        for j, k in drafts.items():
            seq = plan[j].seq
            plan[j].spec_token_ids = seq.spec_token_ids[:k]
            plan[j].spec_probs = None if seq.spec_probs is None else seq.spec_probs[:k]
        return SchedulerOutput(plan, single and bool(plan), self.num_preemptions)

    def schedule_ahead(self, inflight: SchedulerOutput, sampled: list[int], admits: Callable[[Sequence], bool]
                       ) -> tuple[SchedulerOutput, list[int | None]] | None:
        """Async scheduling: the step after `inflight`, planned while it runs, before its tokens are
        known. `sampled`: the rows of `inflight` that sample a token (in its order). Each of its
        sequences goes on: a sampling row computes the token in flight next (unless that token
        brings it to max_tokens or max_model_len, or it has finished since), a prefill chunk that
        samples nothing is followed by the next chunk; then waiting requests are admitted as
        `schedule` admits them, while `admits` accepts them. Returns the plan and, per row, the
        index in `inflight`'s sampled tokens of its input token (None: a row whose tokens the host
        knows). None when the step is not what `schedule` would plan after `inflight`: a running
        sequence outside it, the budget or the pool short without a preemption, or a waiting request
        `admits` refuses while a sequence slot is free (`schedule` then plans once `inflight` is
        applied). A sequence that the token in flight stops (EOS, a stop id or string) computes one
        more row, which the update drops."""
        running, done = self.running, Status.FINISHED
        tables, bs = self.blocks.tables, self.blocks.block_size
        plain_allocate = type(self.blocks).allocate is BlockManager.allocate
        budget = self.max_num_batched_tokens
        plan: list[ScheduledSequence] = []
        rows: list[int | None] = []
        every = len(sampled) == len(inflight.scheduled)  # each row samples (a steady decode step): index = row
        token_of = {} if every else {row: j for j, row in enumerate(sampled)}
        k = 0  # the running sequences must be `inflight`'s unfinished ones, in its order
        for i, s in enumerate(inflight.scheduled):
            seq = s.seq
            if seq.status is done:
                continue
            if k == len(running) or running[k] is not seq:
                return None
            k += 1
            j = i if every else token_of.get(i)
            end = s.start + s.num_new
            if j is not None:
                produced = len(seq.output_ids) + 1  # with the token in flight
                if produced >= seq.params.max_tokens or len(seq.prompt_ids) + produced >= seq.max_model_len:
                    continue
                n = 1
            else:  # the next chunk of a prompt, all of it known
                n = min(len(seq.prompt_ids) + len(seq.output_ids) - end, budget)
            if n <= 0 or not (plain_allocate and len(tables.get(seq.request_id, ())) * bs >= end + n
                              or self.blocks.allocate(seq, end + n)):
                return None
            seq.num_computed = end  # what the update of `inflight` sets (admissions below read the running ones)
            plan.append(ScheduledSequence(seq, end, n, list(tables[seq.request_id])))
            rows.append(j)
            budget -= n
        if k != len(running):
            return None
        if self.waiting and len(running) < self.max_num_seqs:
            if not admits(self.waiting[0]):
                return None  # planned once `inflight` is applied, so that it is not passed over
            seqs: list[Sequence] = []
            num_new: list[int] = []
            self._admit(seqs, num_new, budget, False, admits)
            plan += [ScheduledSequence(seq, seq.num_computed, n, list(tables[seq.request_id]))
                     for seq, n in zip(seqs, num_new)]
            rows += [None] * len(seqs)
        if not plan:
            return None
        return SchedulerOutput(plan, None not in rows, self.num_preemptions), rows

    def _admit(self, seqs: list[Sequence], num_new: list[int], budget: int, single: bool,
           admits: Callable[[Sequence], bool] | None = None) -> tuple[int, bool]:
        """Admit waiting requests first-come first-served while budget, sequence slots and blocks
        last (appended to `seqs`/`num_new`); returns the budget left and whether the step stays
        single-token. `admits`: stop at the first request it refuses (async scheduling's)."""
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if admits is not None and not admits(seq):
                break
            embed = seq.params.embed  # pooled over every position: no prefix hits, never chunked
            hits = self.blocks.lookup_prefix(seq) if seq.num_computed == 0 and not self.blocks.table(seq) and not embed else []
            start = len(hits) * self.blocks.block_size
            n = min(seq.num_tokens - start, budget)
            if embed and n < seq.num_tokens:
                break  # waits for a step with budget for all of it (the server bounds it by the budget)
            if n < (first := self.blocks.first_chunk(seq)) - start:
                if seqs:
                    break  # an encoder input runs whole: waits for a step of its own ...
                n = first - start  # ... which it may take past the budget rather than wait forever
            if not self.blocks.allocate(seq, start + n, prefix_hits=hits):
                break
            self.blocks.record_lookup(seq.num_tokens, start)
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = start
            if seq.scheduled_time is None:
                seq.scheduled_time = time.monotonic()
            seq.num_computed = start
            self.waiting.popleft()
            if n != 1 or seq.num_tokens - start != 1 or seq.params.max_tokens <= 0 or seq.params.embed:
                single = False
            seq.status = Status.RUNNING
            self.running.append(seq)
            seqs.append(seq)
            num_new.append(n)
            budget -= n
        return budget, single

    def remove_finished(self) -> list[Sequence]:
        done = [s for s in self.running if s.is_finished]
        if done:
            self.running = [s for s in self.running if not s.is_finished]
            for s in done:
                self.blocks.free_seq(s)
        return done

    def abort(self, seq: Sequence) -> None:
        """Stop a request wherever it is and release its blocks now."""
        seq.abort()
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free_seq(seq)
