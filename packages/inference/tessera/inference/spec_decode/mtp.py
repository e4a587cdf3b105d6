"""Speculative drafts from the target's own multi-token-prediction modules (DeepSeek-V3; vLLM's
`deepseek_mtp`), `--speculative-config '{"method": "mtp", "num_speculative_tokens": k}'`.

The MTP depth reads, at position p, the target's final-normed hidden state at p and the token at
p + 1, and predicts the token at p + 2. So after each target step the proposer first catches the
MTP up on every position whose target hidden state is now known (the prompt's chunks, the newest
token and the accepted drafts; rows past the accepted tokens are dropped), in one batched forward
whose last row per sequence gives the first draft; drafts 2..k each run one more position with the
MTP's own output hidden state in place of the target's (not yet computed) one and the previous
draft as the token, as vLLM does. Those speculative positions are rewritten by the next catch-up.
Only the first depth drafts (DeepSeek-V3 ships one). The MTP keeps latents in a pool of its own
(one layer per depth), with its own block tables.

Where the MTP forward runs is the only difference between one device and tensor parallel, as for
the target (ModelRunner vs executor.TensorParallelRunner): `MTPProposer` keeps all the bookkeeping
(which hidden rows to keep, which positions to draft, block tables, drawing the drafts) on the
driver, and hands each forward to an `MTPDrafter` (worker/latent/mtp.py) in this process, or to
`TensorParallelMTP`, which sends it to the workers. There each rank keeps the target's hidden rows
of every step (they are whole on every rank after the all-reduce; the target step's command names
the sequences, so the hand-off costs no message of its own), runs the MTP over its shard with its
own latent pool, and rank 0 returns the gathered logits rows, from which the driver draws the
drafts exactly as on one device. A decode step with k drafts of sampled (or penalised, biased)
rows is 1 + k round trips to the workers, as it is 1 + k forwards on one device: each draft's token
is drawn on the driver (the request's generator) before the next MTP position can read it. When
every drafting row is greedy and unprocessed, its draft is the row's argmax, which the workers
take themselves (MTPDrafter.draft_chain): one MTP round trip for all k, 2 per decode step.

A sequence whose earlier positions the target never computed in this engine (a prefix-cache hit)
has no hidden states for them: it is not drafted for (it decodes one token per step; outputs are
the same either way). Drafts are drawn as the request's sampler would draw from the MTP logits
and kept for exact verification (sampler.verify), so greedy output is the output without drafts.
"""

from __future__ import annotations

import torch

from tessera.common.errors import UserError
from tessera.inference.core.block_manager import BlockManager
from tessera.inference.core.sequence import Sequence
from tessera.inference.sample.sampler import Hypothetical, needs_processing, pick, sampling_row
from tessera.inference.worker.batch import BatchSeq
from tessera.inference.worker.latent.mtp import MTPDrafter, MTPRunner, Op


def num_drafts_for(seq: Sequence, k: int) -> int:
    """How many drafts are worth proposing for seq now: none for structured output, and never
    more than it can still use (max_tokens, max_model_len: all k accepted + 1 must fit)."""
    if seq.matcher is not None or seq.is_finished or seq.num_computed != seq.num_tokens - 1:
        return 0
    left = min(seq.params.max_tokens - len(seq.output_ids), seq.max_model_len - seq.num_tokens)
    return max(0, min(k, left - 1))


class TensorParallelMTP:
    """The MTP forward on the tensor-parallel workers: each keeps an MTPDrafter over its shard
    (executor.py's `mtp_attach`, `mtp` commands); the driver's TensorParallelRunner names the
    sequences of each target step so that the workers keep their hidden rows."""

    def __init__(self, target, num_blocks: int, block_size: int):
        self.target = target
        self.executor = target.executor
        self.executor.send_all({"t": "mtp_attach", "num_blocks": num_blocks, "block_size": block_size})
        self.executor.recv_ready()
        target.step_rows = {}  # TensorParallelRunner records each step's (start, rows) and sends the ids

    def rows_computed(self) -> dict[str, tuple[int, int]]:
        return dict(self.target.step_rows)

    def update(self, ops: list[Op], drop: list[str]) -> None:
        if ops or drop or self.target.step_rows:  # one way, read before the next command: no reply awaited
            self.executor.send_all({"t": "mtp", "ops": ops, "drop": drop})
        self.target.step_rows.clear()

    def draft(self, ops: list[Op], drop: list[str], batch: list[BatchSeq], rids: list[str], catch_up: bool,
              logits_rows: list[int]) -> torch.Tensor:
        self.target.step_rows.clear()
        self.executor.send_all({"t": "mtp", "ops": ops, "drop": drop, "rids": rids, "catch_up": catch_up,
                                "rows": logits_rows,
                                "batch": [[s.tokens, s.start, s.block_table, s.num_q] for s in batch]})
        return self.executor.recv_logits(self.target.device)[0]

    def draft_chain(self, ops: list[Op], drop: list[str], batch: list[BatchSeq], rids: list[str],
                    logits_rows: list[int], wants: list[int]) -> list[torch.Tensor]:
        """Greedy drafts chained on the workers (MTPDrafter.draft_chain): one round trip for all k."""
        self.target.step_rows.clear()
        self.executor.send_all({"t": "mtp", "ops": ops, "drop": drop, "rids": rids, "rows": logits_rows,
                                "wants": wants, "batch": [[s.tokens, s.start, s.block_table, s.num_q] for s in batch]})
        rows = self.executor.recv_logits(self.target.device)[0]
        sizes = [sum(w > j for w in wants) for j in range(max(wants))]
        return list(rows.split(sizes))


class MTPProposer:
    """The MTP proposer (module docstring): bookkeeping on the driver, the forward through `mtp`."""

    chain = True  # greedy drafts chained where the model is (benchmarks/deepseek_serving.py measures without)

    def __init__(self, k: int, num_blocks: int, block_size: int):
        self.k = k
        self.num_blocks, self.block_size = num_blocks, block_size
        self.blocks = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
        self.mtp: MTPDrafter | TensorParallelMTP | None = None  # attach()
        self.done: dict[str, int] = {}  # request id -> MTP positions computed from the target's hidden states
        self.pending: dict[str, int] = {}  # target hidden rows kept from position done[rid] on
        self.seqs: dict[str, Sequence] = {}

    @staticmethod
    def check(model_cfg, tensor_parallel: int) -> None:
        """Refuse (one line) a target this proposer cannot draft for, before any worker starts."""
        if getattr(model_cfg, "mtp", None) is None:
            raise UserError("--speculative-config method mtp: this model has no multi-token-prediction modules "
                            "(model.mtp; DeepSeek-V3's num_nextn_predict_layers); use method ngram or a draft model")

    def attach(self, target) -> None:
        """Read the target runner's hidden states from now on; run the MTP beside it (after `check`)."""
        if hasattr(target, "executor"):  # tensor parallel: the model and its hidden states are on the workers
            self.mtp = TensorParallelMTP(target, self.num_blocks, self.block_size)
            return
        target.step_hidden = {}
        self.mtp = MTPDrafter(MTPRunner(target.model, self.num_blocks, self.block_size, target.device,
                                        target.dtype, kv_dtype=target.kv_dtype), target.step_hidden)

    @property
    def runner(self):
        """The MTP runner when it runs in this process (None under tensor parallel)."""
        return getattr(self.mtp, "runner", None)

    def _forget(self, live: set[str], drop: list[str]) -> None:
        for rid in [r for r in self.done if r not in live]:
            if rid in self.seqs:
                self.blocks.free_seq(self.seqs.pop(rid))
            self.done.pop(rid, None)
            self.pending.pop(rid, None)
            drop.append(rid)

    def _take_hidden(self, running: list[Sequence]) -> list[Op]:
        """Keep each sequence's newly known target hidden rows (positions < num_tokens - 1): the
        decisions, for wherever the rows are."""
        computed = self.mtp.rows_computed()
        ops: list[Op] = []
        for seq in running:
            got = computed.get(seq.request_id)
            if got is None:
                continue
            start, n = got
            rid = seq.request_id
            done = self.done.setdefault(rid, 0)
            have = done + self.pending.get(rid, 0)
            keep = None
            if start < have:  # recomputed (preemption): those positions' MTP latents are rewritten
                done = self.done[rid] = min(done, start)
                keep = self.pending[rid] = max(0, start - done)
                have = start
            if start > have:  # positions the target skipped (a prefix-cache hit): no drafts for this one
                self.done[rid] = -1
                self.pending[rid] = 0
                ops.append((rid, 0, 0))
                continue
            valid = max(0, min(n, seq.num_tokens - 1 - start))
            if not (valid and self.done[rid] >= 0):
                valid = 0
            self.pending[rid] = self.pending.get(rid, 0) + valid
            if keep is not None or valid:
                ops.append((rid, keep, valid))
        return ops

    def _catch_up(self, seqs: list[Sequence]) -> tuple[list[BatchSeq], list[int]]:
        """The first draft's forward: positions done..num_tokens-2 read tokens done+1..num_tokens-1."""
        batch, rows, offset = [], [], 0
        for s in seqs:
            start = self.done[s.request_id]
            tokens = s.tokens(start + 1, s.num_tokens)
            batch.append(BatchSeq(tokens, start, list(self.blocks.table(s)), 1 if len(tokens) == 1 else 0))
            offset += len(tokens)
            rows.append(offset - 1)
        return batch, rows

    @torch.inference_mode()
    def propose(self, running: list[Sequence]) -> None:
        assert self.mtp is not None, "attach() first"
        drop: list[str] = []
        self._forget({s.request_id for s in running}, drop)
        ops = self._take_hidden(running)
        want: dict[str, int] = {}
        for seq in running:
            seq.spec_token_ids, seq.spec_probs = [], None
            rid = seq.request_id
            n = num_drafts_for(seq, self.k)
            have = self.done.get(rid, -1) + self.pending.get(rid, 0)
            # Drafting needs the target's hidden state up to the position before the newest token.
            if n and self.done.get(rid, -1) >= 0 and self.pending.get(rid, 0) and have == seq.num_tokens - 1 \
                    and self.blocks.allocate(seq, seq.num_tokens + n - 1):
                self.seqs[rid] = seq
                want[rid] = n
        seqs = [s for s in running if s.request_id in want]
        if not seqs:
            self.mtp.update(ops, drop)
            return
        views = {s.request_id: Hypothetical.of(s) for s in seqs}
        probs: dict[str, list[torch.Tensor]] = {s.request_id: [] for s in seqs}
        rids = [s.request_id for s in seqs]
        # Greedy rows nothing processes draw the argmax: the workers can chain the drafts themselves.
        chained = None
        if self.chain and max(want.values()) > 1 and all(s.params.greedy and not needs_processing(views[s.request_id]) for s in seqs):
            batch, rows = self._catch_up(seqs)
            chained = self.mtp.draft_chain(ops, drop, batch, rids, rows, [want[r] for r in rids])
        for j in range(max(want.values())):
            active = [s for s in seqs if want[s.request_id] > j]
            if chained is not None:
                logits = chained[j]
            elif j == 0:
                batch, rows = self._catch_up(seqs)
                logits = self.mtp.draft(ops, drop, batch, rids, True, rows)
            else:  # the previous draft at position num_tokens - 2 + j, the MTP's own hidden state
                batch = [BatchSeq([s.spec_token_ids[-1]], s.num_tokens - 2 + j, list(self.blocks.table(s)), 1)
                         for s in active]
                logits = self.mtp.draft([], [], batch, [s.request_id for s in active], False, list(range(len(active))))
            for s, row in zip(active, logits):
                rid = s.request_id
                view = views[rid]
                token, q = pick(sampling_row(row, view), s.params, s.generator)
                s.spec_token_ids.append(token)
                view.output_ids.append(token)
                if q is not None:
                    probs[rid].append(q)
                if j == 0:
                    self.done[rid] = s.num_tokens - 1
                    self.pending[rid] = 0
        for s in seqs:
            if probs[s.request_id]:
                s.spec_probs = torch.stack(probs[s.request_id])
