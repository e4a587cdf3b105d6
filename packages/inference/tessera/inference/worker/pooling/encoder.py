"""Serving an encoder (BERT): embeddings only, with no KV cache.

Every request is an embed request, scheduled whole (scheduler.py) and finished in its step, so
nothing is ever cached: `NoKVCache` gives the scheduler its block-manager interface with an empty
pool, and `EncoderRunner` runs each step's sequences as one padded batch through the model's
bidirectional forward (padding masked, as transformers' BertModel takes it), then pools each.

Under `--tensor-parallel N` the driver's `TensorParallelEncoderRunner` sends each step's inputs
(request id, token ids) to the N workers of worker/tensor_parallel/executor.py; each runs an `EncoderRunner` over
its shard (heads, MLP width and vocabulary split by the encoder's parallel plan, the row layers'
all-reduces between them, so every rank holds the whole hidden states), and rank 0 sends the
pooled vectors back.
"""

from __future__ import annotations

import torch

from tessera.inference.core.block_manager import BlockManager
from tessera.inference.core.scheduler import SchedulerOutput
from tessera.inference.core.sequence import Sequence
from tessera.inference.worker.batch import ModelRunnerOutput, right_padded
from tessera.inference.worker.cpu_linear import pack_linears
from tessera.inference.worker.model_runner import ModelRunner, undivided
from tessera.inference.worker.pooling.runner import pool


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
    pools = True

    @staticmethod
    def tensor_parallel_problem(tp: int, cfg) -> str | None:
        return encoder_problem(tp, cfg)  # what its plan splits (the loader asks, through worker/kinds.py)

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
        out.pooled.update(self.pool_inputs(step_inputs(plan)))
        return out

    @torch.inference_mode()
    def pool_inputs(self, inputs: list[tuple[str, list[int]]]) -> dict[str, list[float]]:
        """(request id, token ids) -> pooled vector, the inputs run in padded batches of like length."""
        pooled: dict[str, list[float]] = {}
        for group in _length_groups(inputs):
            self._run(group, pooled)
        return pooled

    def _run(self, group: list[tuple[str, list[int]]], pooled: dict[str, list[float]]) -> None:
        tokens, mask = right_padded([ids for _, ids in group], self.device)
        result = self.model(tokens, attention_mask=None if bool(mask.all()) else mask, return_hidden=True)
        hidden = result if isinstance(result, torch.Tensor) else result.hidden
        for i, (request_id, ids) in enumerate(group):
            pooled[request_id] = pool(self.pool_mode, hidden[i, :len(ids)]).float().tolist()

    def forward(self, plan: SchedulerOutput, logits_rows: list[int]) -> torch.Tensor:
        raise RuntimeError("an encoder computes no logits here (embed requests only)")


def step_inputs(plan: SchedulerOutput) -> list[tuple[str, list[int]]]:
    """(request id, token ids) of every embed request of the step (each scheduled whole)."""
    for s in plan.scheduled:
        assert s.start == 0 and s.completes_prompt, "an embed request is scheduled whole"
    return [(s.seq.request_id, list(s.tokens())) for s in plan.scheduled]


def _length_groups(inputs: list[tuple[str, list[int]]], waste: float = 1.25) -> list[list]:
    """The step's sequences sorted by length and cut into padded batches that compute at most
    `waste` x their real tokens (as sentence-transformers sorts its inputs before batching): one
    step mixes lengths, and one batch padded to the longest would compute mostly padding."""
    order = sorted(inputs, key=lambda x: len(x[1]), reverse=True)
    groups: list[list] = []
    for item in order:
        group = groups[-1] if groups else None
        if group is not None and len(group[0][1]) * (len(group) + 1) <= waste * (
                sum(len(g[1]) for g in group) + len(item[1])):
            group.append(item)
        else:
            groups.append([item])
    return groups


def encoder_runner(model: torch.nn.Module, device: torch.device, dtype: torch.dtype, cpu_linear: str,
                   batch_hint: int, quantized: bool) -> EncoderRunner:
    """The encoder (or a tensor-parallel worker's shard of it) ready to serve: on CPU its Linear
    weights prepacked for oneDNN (cpu_linear.py), as the decoder's are."""
    if device.type == "cpu" and not quantized:
        pack_linears(model, cpu_linear, batch_hint=batch_hint)
    return EncoderRunner(model, 0, 0, device, dtype)


def encoder_problem(tp: int, cfg) -> str | None:
    """Why an encoder cannot be split over `tp` ranks (a phrase), or None: its plan splits the
    attention heads, the MLP width and the vocabulary rows."""
    return undivided(tp, [("attention heads", cfg.num_heads), ("MLP width", cfg.ffn_hidden_size),
                          ("vocabulary rows", cfg.vocab_rows)])


class TensorParallelEncoderRunner(EncoderRunner):
    """The driver's encoder runner under --tensor-parallel: the workers (worker/tensor_parallel/executor.py) hold
    the shards and pool; it holds no weights."""

    def __init__(self, executor, device: torch.device):  # noqa: D107 - no super(): no model
        self.executor, self.device = executor, device
        self.model = None

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        out = ModelRunnerOutput()
        if self.pool_mode is None:
            raise RuntimeError("an encoder runner without pooling")
        out.pooled.update(self.executor.pool(step_inputs(plan), self.pool_mode))
        return out

    def close(self) -> None:
        self.executor.shutdown()
