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
from tessera.inference.sample.sampler import Hypothetical, pick, sampling_row
from tessera.inference.sample.spec_decode import num_drafts_for
from tessera.inference.worker.batch import BatchSeq


class MTPProposer:
    def __init__(self, k: int, num_blocks: int, block_size: int):
        self.k = k
        self.num_blocks, self.block_size = num_blocks, block_size
        self.blocks = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
        self.runner = None  # attach(): an MTPRunner over the target's model
        self.target = None
        self.done: dict[str, int] = {}  # request id -> MTP positions computed from the target's hidden states
        self.pending: dict[str, list[torch.Tensor]] = {}  # target hidden rows from position done[rid] on
        self.seqs: dict[str, Sequence] = {}

    def attach(self, target) -> None:
        """Read the target runner's hidden states from now on; run the MTP on its model."""
        from tessera.inference.worker.latent.mtp import MTPRunner

        model = target.model
        if getattr(model, "mtp", None) is None or not hasattr(target, "step_hidden"):
            raise UserError("--speculative-config method mtp: this model has no multi-token-prediction modules "
                            "(model.mtp; DeepSeek-V3's num_nextn_predict_layers); use method ngram or a draft model")
        target.step_hidden = {}
        self.target = target
        self.runner = MTPRunner(model, self.num_blocks, self.block_size, target.device, target.dtype,
                                kv_dtype=target.kv_dtype)

    def release(self, rid: str) -> None:
        self.blocks.free_seq(self.seqs.pop(rid))
        self.done.pop(rid, None)
        self.pending.pop(rid, None)

    def _take_hidden(self, running: list[Sequence]) -> None:
        """Append each sequence's newly known target hidden states (positions < num_tokens - 1)."""
        for seq in running:
            got = self.target.step_hidden.pop(seq.request_id, None)
            if got is None:
                continue
            start, rows = got
            rid = seq.request_id
            done = self.done.setdefault(rid, 0)
            have = done + sum(r.shape[0] for r in self.pending.get(rid, []))
            if start < have:  # recomputed (preemption): those positions' MTP latents are rewritten
                done = self.done[rid] = min(done, start)
                kept, pos = [], done
                for r in self.pending.get(rid, []):
                    kept.append(r[:max(0, min(r.shape[0], start - pos))])
                    pos += r.shape[0]
                self.pending[rid] = [r for r in kept if r.shape[0]]
                have = start
            if start > have:  # positions the target skipped (a prefix-cache hit): no drafts for this one
                self.done[rid] = -1
                continue
            valid = max(0, min(rows.shape[0], seq.num_tokens - 1 - start))
            if valid and self.done[rid] >= 0:
                self.pending.setdefault(rid, []).append(rows[:valid])
        self.target.step_hidden.clear()

    @torch.inference_mode()
    def propose(self, running: list[Sequence]) -> None:
        live = {s.request_id for s in running}
        for rid in [r for r in self.done if r not in live]:
            if rid in self.seqs:
                self.release(rid)
            else:
                self.done.pop(rid, None)
                self.pending.pop(rid, None)
        self._take_hidden(running)
        want: dict[str, int] = {}
        for seq in running:
            seq.spec_token_ids, seq.spec_probs = [], None
            rid = seq.request_id
            n = num_drafts_for(seq, self.k)
            have = self.done.get(rid, -1) + sum(r.shape[0] for r in self.pending.get(rid, []))
            # Drafting needs the target's hidden state up to the position before the newest token.
            if n and self.done.get(rid, -1) >= 0 and have == seq.num_tokens - 1 \
                    and self.blocks.allocate(seq, seq.num_tokens + n - 1):
                self.seqs[rid] = seq
                want[rid] = n
        seqs = [s for s in running if s.request_id in want]
        if not seqs:
            return
        views = {s.request_id: Hypothetical.of(s) for s in seqs}
        probs: dict[str, list[torch.Tensor]] = {s.request_id: [] for s in seqs}
        last: dict[str, torch.Tensor] = {}
        for j in range(max(want.values())):
            active = [s for s in seqs if want[s.request_id] > j]
            batch, hidden, rows, offset = [], [], [], 0
            for s in active:
                rid = s.request_id
                if j == 0:  # catch up: positions done..num_tokens-2 read tokens done+1..num_tokens-1
                    start = self.done[rid]
                    h = torch.cat(self.pending.pop(rid))
                    tokens = s.tokens(start + 1, s.num_tokens)
                else:  # the previous draft at position num_tokens - 2 + j, the MTP's own hidden state
                    start, h, tokens = s.num_tokens - 2 + j, last[rid], [s.spec_token_ids[-1]]
                batch.append(BatchSeq(tokens, start, list(self.blocks.table(s)), 1 if len(tokens) == 1 else 0))
                hidden.append(h)
                offset += len(tokens)
                rows.append(offset - 1)
            logits, out = self.runner.draft(0, batch, torch.cat(hidden), rows)
            for s, row, r in zip(active, logits, rows):
                rid = s.request_id
                last[rid] = out[r:r + 1]
                view = views[rid]
                token, q = pick(sampling_row(row, view), s.params, s.generator)
                s.spec_token_ids.append(token)
                view.output_ids.append(token)
                if q is not None:
                    probs[rid].append(q)
                if j == 0:
                    self.done[rid] = s.num_tokens - 1
        for s in seqs:
            if probs[s.request_id]:
                s.spec_probs = torch.stack(probs[s.request_id])
