"""Shared pieces of the parallel parity tests: the tiny model, the data, the single-process reference.

The reference is the plain model with torch.optim.AdamW and clip_grad_norm_, one process, the
whole global batch at once: what every parallel layout must reproduce.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tessera.common.layers.moe import RouterStats
from tessera.common.models.causal_lm.config import ModelConfig
from tessera.common.models.causal_lm.model import build_model

MODEL = dict(arch="llama", vocab_size=128, hidden_size=32, num_layers=4, num_heads=4, num_kv_heads=2,
             ffn_hidden_size=64, max_seq_len=32, tie_embeddings=True)
OPTIM = dict(lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, grad_clip=0.5)  # TrainConfig.optim
SEQ = 16
GLOBAL_BATCH = 8
DATA_SEED = 99
MODEL_SEED = 0
# A mixture of experts (first layer dense, shared expert, balancing bias): aux loss off, since it is
# a per-micro-batch quantity (a layout that splits the batch differently trains on another mean).
MOE = dict(moe=dict(num_experts=4, top_k=2, ffn_hidden_size=32, first_k_dense=1, num_shared_experts=1,
                    aux_loss_coef=0.0, bias_balancing=True, bias_update_rate=0.01))
EVAL_STEP = 1000  # data index of the held-out batch used for eval parity


def model_config(**overrides) -> ModelConfig:
    return ModelConfig(**{**MODEL, **overrides})


def sections(layout, training: dict | None = None, parallel: dict | None = None):
    """TrainConfig's training, parallel and optim sections, which the trainer hands the parallel
    runtime, for a runtime built directly: SEQ-token samples, GLOBAL_BATCH of them per step,
    micro-batches of one unless `training` says otherwise; the parallel section holds `layout`."""
    from tessera.trainer.config import OptimConfig, ParallelConfig, TrainingConfig

    t = TrainingConfig(**{"seq_length": SEQ, "global_batch_size": GLOBAL_BATCH, "micro_batch_size": 1,
                          **(training or {})})
    p = ParallelConfig(**layout.model_dump(exclude={"data"}), **(parallel or {}))
    return t, p, OptimConfig(**OPTIM)


def batch(step: int, cfg: ModelConfig, global_batch: int = GLOBAL_BATCH, seq: int = SEQ):
    """Tokens and targets [global_batch, seq] of step `step` (deterministic)."""
    g = torch.Generator().manual_seed(DATA_SEED + step)
    x = torch.randint(0, cfg.vocab_size, (global_batch, seq + 1), generator=g)
    return x[:, :-1].contiguous(), x[:, 1:].contiguous()


EOD = 0  # the end-of-document token of the packed-documents batches
DOCUMENTS = dict(eod_id=EOD, reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True)


def documents_batch(step: int, cfg: ModelConfig, global_batch: int = GLOBAL_BATCH, seq: int = SEQ):
    """Packed documents: (tokens, targets, model_inputs) of step `step`; about one token in five
    is an end-of-document, so every sample holds several documents (positions restart after
    each, attention stays inside each, no loss where the input is EOD)."""
    from tessera.trainer.objectives.documents import DocumentMasking

    g = torch.Generator().manual_seed(DATA_SEED + step)
    x = torch.randint(1, cfg.vocab_size, (global_batch, seq + 1), generator=g)
    x[torch.rand(x.shape, generator=g) < 0.2] = EOD
    tokens, targets = x[:, :-1].contiguous(), x[:, 1:].contiguous()
    masking = DocumentMasking(**DOCUMENTS)
    return tokens, masking.mask_labels(tokens, targets), masking.model_inputs(tokens)


def reference_optimizer(model: torch.nn.Module) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.ndim >= 2]
    nodecay = [p for p in model.parameters() if p.ndim < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": OPTIM["weight_decay"]},
                              {"params": nodecay, "weight_decay": 0.0}],
                             lr=OPTIM["lr"], betas=(OPTIM["beta1"], OPTIM["beta2"]), eps=OPTIM["eps"])


def reference_run(cfg: ModelConfig, steps: int, start: int = 0, model=None, opt=None, autocast_bf16: bool = False,
                  grad_norms: list[float] | None = None, documents: bool = False):
    """Losses of `steps` single-process steps from step `start`; returns (losses, model, optimizer).

    With `autocast_bf16` the forward runs under torch.autocast(bf16) over the fp32 model (the
    trainer's bf16 mode). The pre-clip gradient norms are appended to `grad_norms` when given.
    With `documents` the batches are `documents_batch`'s packed documents (loss: mean over the
    counted tokens of the batch)."""
    torch.manual_seed(0)
    model = model if model is not None else build_model(cfg, seed=MODEL_SEED)
    opt = opt if opt is not None else reference_optimizer(model)
    router = RouterStats(model) if cfg.moe is not None else None  # balancing bias, after each step
    losses = []
    for step in range(start, start + steps):
        inputs: dict = {}
        if documents:
            tokens, targets, inputs = documents_batch(step, cfg)
        else:
            tokens, targets = batch(step, cfg)
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast_bf16):
            logits = model(tokens, **inputs)
        loss = F.cross_entropy(logits.float().reshape(-1, cfg.vocab_size), targets.reshape(-1))
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), OPTIM["grad_clip"])
        if grad_norms is not None:
            grad_norms.append(norm.item())
        opt.step()
        if router is not None:
            router.step()
        losses.append(loss.item())
    return losses, model, opt


@torch.no_grad()
def reference_eval(model, cfg: ModelConfig) -> float:
    tokens, targets = batch(EVAL_STEP, cfg)
    logits = model(tokens)
    return F.cross_entropy(logits.reshape(-1, cfg.vocab_size), targets.reshape(-1)).item()


def reference_run_bf16(cfg: ModelConfig, steps: int):
    """bf16 parameters, fp32 master weights and gradients, one process: (losses, model)."""
    model = build_model(cfg, seed=MODEL_SEED, dtype=torch.bfloat16)
    params = list(model.parameters())
    masters = [torch.nn.Parameter(p.detach().float().clone()) for p in params]
    opt = torch.optim.AdamW([{"params": [m for m in masters if m.ndim >= 2], "weight_decay": OPTIM["weight_decay"]},
                             {"params": [m for m in masters if m.ndim < 2], "weight_decay": 0.0}],
                            lr=OPTIM["lr"], betas=(OPTIM["beta1"], OPTIM["beta2"]), eps=OPTIM["eps"])
    losses = []
    for step in range(steps):
        tokens, targets = batch(step, cfg)
        model.zero_grad(set_to_none=True)
        logits = model(tokens).float()
        loss = F.cross_entropy(logits.reshape(-1, cfg.vocab_size), targets.reshape(-1))
        loss.backward()
        for m, p in zip(masters, params):
            m.grad = p.grad.float()
        torch.nn.utils.clip_grad_norm_(masters, OPTIM["grad_clip"])
        opt.step()
        with torch.no_grad():
            for m, p in zip(masters, params):
                p.copy_(m)
        losses.append(loss.item())
    return losses, model


class deferred_param_gathers:  # noqa: N801 (a context manager, used as `with deferred_param_gathers():`)
    """overlap_param_gather's all-gathers issued only when a hook (or finish) waits for them, the
    other ranks' slices NaN until then: a weight read before its wait is NaN, whatever the timing
    (an in-flight gloo gather often lands before an early read, and hides it)."""

    def __enter__(self):
        import torch.distributed as dist

        import tessera.trainer.parallel.data_parallel as data_parallel

        self.module, self.real = data_parallel, data_parallel.all_gather_flat
        real = self.real

        class Deferred:
            def __init__(self, out, own, group):
                self.args = out, own, group

            def wait(self):
                out, own, group = self.args
                real(out, own, group=group)

        def gather(out, own, group=None, async_op=False):
            if not async_op:
                return real(out, own, group=group)
            rank, n = dist.get_rank(group), own.numel()
            out.fill_(float("nan"))
            out[rank * n:(rank + 1) * n].copy_(own)
            return Deferred(out, own, group)

        data_parallel.all_gather_flat = gather
        return self

    def __exit__(self, *exc):
        self.module.all_gather_flat = self.real
