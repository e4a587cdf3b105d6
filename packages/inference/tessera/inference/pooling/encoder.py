"""Serving an encoder (BERT): embeddings only, with no KV cache.

Every request is an embed request, scheduled whole (scheduler.py) and finished in its step, so
nothing is ever cached: `NoKVCache` gives the scheduler its block-manager interface with an empty
pool, and `EncoderRunner` runs each step's sequences as one padded batch through the model's
bidirectional forward (padding masked, as transformers' BertModel takes it), then pools each.
"""

from __future__ import annotations

import torch

from tessera.inference.core.block_manager import BlockManager
from tessera.inference.core.scheduler import SchedulerOutput
from tessera.inference.core.sequence import Sequence
from tessera.inference.pooling.runner import pool
from tessera.inference.worker.batch import ModelRunnerOutput
from tessera.inference.worker.model_runner import ModelRunner


class NoKVCache(BlockManager):
    """The scheduler's cache for a model that keeps nothing between steps: every allocation fits."""

    holds_kv = False

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 prefix_cache_hash: str = "builtin"):
        super().__init__(0, block_size, False, prefix_cache_hash)

    def lookup_prefix(self, seq: Sequence) -> list[int]:
        return []

    def allocate(self, seq: Sequence, num_tokens: int, prefix_hits: list[int] | None = None) -> bool:
        return True

    def commit_full_blocks(self, seq: Sequence) -> None:
        return None

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        return None

    def free_seq(self, seq: Sequence) -> None:
        return None


class EncoderRunner(ModelRunner):
    """Runs embed requests through an encoder: one padded batch per step, pooled per sequence."""

    generates = False  # serves /v1/embeddings only: completions and chat are refused
    pool_mode: str | None = None

    def __init__(self, model: torch.nn.Module, num_blocks: int, block_size: int, device: torch.device,
                 dtype: torch.dtype, tp_rank: int = 0, tp_size: int = 1, kv_dtype: torch.dtype | None = None):
        # No super().__init__: it would allocate the KV pool this model never uses.
        self.model, self.cfg, self.device = model, model.cfg, device
        self.num_blocks, self.block_size = 0, block_size
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.kv = torch.empty(0, device=device)

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        out = ModelRunnerOutput()
        if self.pool_mode is None:
            raise RuntimeError("an encoder runner without pooling")
        for group in _length_groups(plan.scheduled):
            self._run(group, out)
        return out

    def _run(self, scheduled: list, out: ModelRunnerOutput) -> None:
        width = max(s.num_new for s in scheduled)
        tokens = torch.zeros(len(scheduled), width, dtype=torch.long)
        mask = torch.zeros(len(scheduled), width, dtype=torch.bool)
        for i, s in enumerate(scheduled):
            assert s.start == 0 and s.completes_prompt, "an embed request is scheduled whole"
            tokens[i, :s.num_new] = torch.tensor(s.tokens())
            mask[i, :s.num_new] = True
        tokens, mask = tokens.to(self.device), mask.to(self.device)
        result = self.model(tokens, attention_mask=None if bool(mask.all()) else mask, return_hidden=True)
        hidden = result if isinstance(result, torch.Tensor) else result.hidden
        for i, s in enumerate(scheduled):
            out.pooled[s.seq.request_id] = pool(self.pool_mode, hidden[i, :s.num_new]).float().tolist()

    def forward(self, plan: SchedulerOutput, logits_rows: list[int]) -> torch.Tensor:
        raise RuntimeError("an encoder computes no logits here (embed requests only)")


def _length_groups(scheduled: list, waste: float = 1.25) -> list[list]:
    """The step's sequences sorted by length and cut into padded batches that compute at most
    `waste` x their real tokens (as sentence-transformers sorts its inputs before batching): one
    step mixes lengths, and one batch padded to the longest would compute mostly padding."""
    order = sorted(scheduled, key=lambda s: s.num_new, reverse=True)
    groups: list[list] = []
    for s in order:
        group = groups[-1] if groups else None
        if group is not None and group[0].num_new * (len(group) + 1) <= waste * (sum(g.num_new for g in group) + s.num_new):
            group.append(s)
        else:
            groups.append([s])
    return groups
