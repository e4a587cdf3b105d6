"""Cross-entropy over vocab-parallel logits: the full [tokens, vocab] logits are never gathered.

Each tensor rank holds logits for a contiguous vocab range. Three all-reduces over the tensor
group give the row max, the target's logit (held by exactly one rank) and the sum of
exponentials; the backward is softmax minus one-hot, computed locally on each shard.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, group: dist.ProcessGroup):
        ctx.in_dtype = logits.dtype
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()  # the softmax statistics need fp32 range and precision
        local_vocab = logits.shape[-1]
        start = dist.get_rank(group) * local_vocab
        world = dist.get_world_size(group)

        row_max = logits.max(dim=-1).values
        if world > 1:
            dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - row_max.unsqueeze(-1)

        local_target = target - start
        outside = (local_target < 0) | (local_target >= local_vocab)
        idx = local_target.masked_fill(outside, 0).unsqueeze(-1)
        target_logit = shifted.gather(-1, idx).squeeze(-1).masked_fill(outside, 0.0)

        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        if world > 1:
            # One call for both sums: [2, ...] stacked.
            both = torch.stack([target_logit, sum_exp])
            dist.all_reduce(both, group=group)
            target_logit, sum_exp = both[0], both[1]
        loss = sum_exp.log() - target_logit

        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, idx, outside)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        softmax, idx, outside = ctx.saved_tensors
        grad = softmax.clone()
        onehot = torch.zeros_like(grad).scatter_(-1, idx, (~outside).unsqueeze(-1).to(grad.dtype))
        grad.sub_(onehot).mul_(grad_loss.unsqueeze(-1))
        return grad.to(ctx.in_dtype), None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor,
                                 group: dist.ProcessGroup) -> torch.Tensor:
    """Per-token loss [...] from local logits [..., V/tp] and global target ids [...]."""
    return _VocabParallelCrossEntropy.apply(logits, target, group)
