"""The multi-token-prediction depths of a DeepSeek-V3 model run as a speculative draft: a latent
runner over the target's own MTP modules (shared weights, already in their serving form), with a
latent cache of one layer per depth (the MTP block's attention sees the depth's own earlier
positions) in blocks of its own (spec_decode/mtp.py hands them out).

`MTPDrafter` is that runner plus the target hidden rows it reads, kept in the process that holds
the model: the engine's on one device, each tensor-parallel worker's (over its shard; every rank
has the final-normed hidden states whole after the all-reduce) under tensor parallel. The driver's
proposer decides which rows to keep and which positions to draft (spec_decode/mtp.py) and sends
only those decisions, so the hidden states never cross a pipe."""

from __future__ import annotations

from functools import partial

import torch

from tessera.inference.worker.batch import BatchSeq
from tessera.inference.worker.latent.runner import LatentRunner

# The proposer's bookkeeping, applied where the rows are: (request id, pending rows to keep (None:
# all), rows of the target's last step to append after them).
Op = tuple[str, "int | None", int]


class MTPRunner(LatentRunner):
    @staticmethod
    def cache_layers(cfg) -> int:
        return cfg.mtp.depth

    def _layer_latent(self, layer: int):
        return super()._layer_latent(layer - self.cfg.num_layers)  # the MTP blocks are layers num_layers + depth

    @torch.inference_mode()
    def draft(self, depth: int, batch: list[BatchSeq], hidden: torch.Tensor,
              logits_rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Depth `depth` over the packed rows: position p of a sequence reads the previous hidden
        state at p (hidden [T, d]) and the token at p + 1 (the BatchSeq's tokens). Returns fp32
        logits of `logits_rows` (each predicts the token at p + 2; under tensor parallel this rank's
        vocabulary slice) and the depth's hidden [T, d]."""
        step = self.prepare(batch, logits_rows)
        attention = partial(self._attention, step)
        out = self.model.mtp_hidden(depth, hidden[None].to(self.model.output_weight().dtype), step.tokens,
                                    step.positions, attention)[0]
        rows = out.index_select(0, step.logits_rows)
        weight = self.model.output_weight()
        return self.model.logits(rows, weight, vocab_start=self.tp_rank * weight.shape[0]).float(), out


class MTPDrafter:
    """The MTP forward over the target's hidden rows, where the model is. `step` holds the rows
    the target computed in its last step (request id -> (first position, rows [n, d])), filled by
    the target's runner (LatentRunner.step_hidden) or, on a worker, by `record`."""

    def __init__(self, runner: MTPRunner, step: dict[str, tuple[int, torch.Tensor]]):
        self.runner = runner
        self.step = step
        self.pending: dict[str, list[torch.Tensor]] = {}  # rows awaiting catch-up, from the proposer's `done` on
        self.last: dict[str, torch.Tensor] = {}  # each sequence's MTP output row of the previous draft

    def rows_computed(self) -> dict[str, tuple[int, int]]:
        """(first position, rows) the target computed for each sequence in its last step."""
        return {rid: (start, rows.shape[0]) for rid, (start, rows) in self.step.items()}

    def record(self, rids: list[str], batch: list[BatchSeq], target: LatentRunner) -> None:
        """A worker's target step: the packed hidden rows [T, d] its runner kept, by sequence (until `update`)."""
        hidden = target.take_hidden()
        assert hidden is not None, "the target runner keeps its hidden rows once step_hidden is set"
        offset = 0
        for rid, s in zip(rids, batch):
            self.step[rid] = (s.start, hidden[offset:offset + s.num_new])
            offset += s.num_new

    def update(self, ops: list[Op], drop: list[str]) -> None:
        """Apply the proposer's decisions; the last step's rows not kept are let go."""
        for rid in drop:
            self.pending.pop(rid, None)
            self.last.pop(rid, None)
        for rid, keep, append in ops:
            rows = self.pending.setdefault(rid, [])
            if keep is not None:
                kept, pos = [], 0
                for r in rows:
                    kept.append(r[:max(0, min(r.shape[0], keep - pos))])
                    pos += r.shape[0]
                rows[:] = [r for r in kept if r.shape[0]]
            if append:
                rows.append(self.step[rid][1][:append])
        self.step.clear()

    @torch.inference_mode()
    def draft(self, ops: list[Op], drop: list[str], batch: list[BatchSeq], rids: list[str], catch_up: bool,
              logits_rows: list[int]) -> torch.Tensor:
        """One MTP forward: with `catch_up` each sequence's pending rows (all of them), else its own
        output row of the previous draft as the hidden state. Returns the logits rows (fp32)."""
        self.update(ops, drop)
        if catch_up:
            hidden = torch.cat([torch.cat(self.pending.pop(rid)) for rid in rids])
        else:
            hidden = torch.cat([self.last[rid] for rid in rids])
        logits, out = self.runner.draft(0, batch, hidden, logits_rows)
        self.last = {rid: out[r:r + 1] for rid, r in zip(rids, logits_rows)}
        return logits


    @torch.inference_mode()
    def draft_chain(self, ops: list[Op], drop: list[str], batch: list[BatchSeq], rids: list[str],
                    logits_rows: list[int], wants: list[int], gather=None) -> list[torch.Tensor]:
        """Greedy drafts without the driver in between: the catch-up, then each further draft from
        the argmax of the previous one's row (what `pick` takes of a greedy, unprocessed row), for
        sequence i while j < wants[i]. `gather`: local logits rows -> whole vocabulary rows (tensor
        parallel; every rank takes the same argmax). Returns each forward's whole rows."""
        gather = gather or (lambda x: x)
        full = gather(self.draft(ops, drop, batch, rids, True, logits_rows))
        out, active = [full], list(range(len(rids)))
        for j in range(1, max(wants)):
            tokens = dict(zip(active, full.argmax(dim=-1).tolist()))
            active = [i for i in active if wants[i] > j]
            step = [BatchSeq([tokens[i]], batch[i].start + batch[i].num_new - 1 + j, batch[i].block_table, 1)
                    for i in active]
            full = gather(self.draft([], [], step, [rids[i] for i in active], False, list(range(len(active)))))
            out.append(full)
        return out


def worker_drafter(target: LatentRunner, num_blocks: int, block_size: int) -> MTPDrafter:
    """A tensor-parallel worker's drafter over its shard; its target runner keeps each step's hidden rows."""
    target.step_hidden = {}  # only as the flag that makes the runner keep them (`_kept`); `record` reads them
    return MTPDrafter(MTPRunner(target.model, num_blocks, block_size, target.device, target.dtype,
                                target.tp_rank, target.tp_size, kv_dtype=target.kv_dtype), {})


def worker_mtp(drafter: MTPDrafter, msg: dict, world: int, group) -> torch.Tensor | None:
    """A worker's `mtp` command: the proposer's decisions, and the draft forward(s) it asks for:
    their whole logits rows (every rank gathers them), which rank 0 returns; None when there is
    nothing to reply."""
    import torch.distributed as dist

    def gather(local: torch.Tensor) -> torch.Tensor:
        slices = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(slices, local.contiguous(), group=group)
        return torch.cat(slices, dim=-1)
    ops = [(rid, keep, append) for rid, keep, append in msg["ops"]]
    if msg.get("batch") is None:
        drafter.update(ops, msg["drop"])
        return None
    batch = [BatchSeq(*s) for s in msg["batch"]]
    if msg.get("wants"):  # greedy drafts chained on the workers: every forward's rows, in order
        return torch.cat(drafter.draft_chain(ops, msg["drop"], batch, msg["rids"], msg["rows"], msg["wants"], gather))
    return gather(drafter.draft(ops, msg["drop"], batch, msg["rids"], msg["catch_up"], msg["rows"]))
