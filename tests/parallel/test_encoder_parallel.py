"""The encoder's (BERT's) tensor-parallel plan computes what the whole model does: TP2 and TP2 with
sequence parallel on gloo, fp32, the same weights and padded batch with token types: hidden states,
pooled states, binary and MLM logits (the rank's vocabulary slice), and the gradient of every
parameter the hidden, pooled and binary outputs reach (the rank's slice of the whole one's; a
sequence-parallel partial gradient summed over the tensor group first).

Training under the parallel runtime (the masked-LM objective, tessera.trainer.mlm.objective): TP2,
TP2+SP, PP2, DP2 and FSDP2 take the same losses and reach the same parameters as one process with
torch's AdamW after a few optimizer steps.

One torchrun launch runs every layout: this file is also the worker (`torchrun ... this_file out.json`).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

MODEL = dict(kind="encoder", vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, ffn_hidden_size=64,
             max_seq_len=16, pooler=True, mlm_head=True, binary_head=True, dropout=0.0, attention_dropout=0.0)
# The split may reorder fp32 sums: its error against an fp64 run of the whole model is held to
# TOL times the one process's own fp32 error against that run (measured: at most 1.7 times).
TOL = 10.0


@pytest.mark.distributed
def test_bert_under_tp2_and_sp_computes_what_the_whole_model_does_and_trains_under_tp_sp_pp_dp_fsdp_like_one_process(tmp_path):
    import subprocess

    out = tmp_path / "errors.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", __file__, str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    errors = json.loads(out.read_text())
    training = errors.pop("training")
    assert set(errors) == {"tp2", "tp2_sp"} and all(len(e) > 20 for e in errors.values())
    bad = {f"{layout}: {k}": v for layout, e in errors.items() for k, v in e.items() if not v <= TOL}
    assert not bad, bad
    # MLM (+ binary head) training: per-step losses within 1e-5 relative, parameters after the
    # steps within 1e-5 normwise (each rank's shards against the one process's).
    assert set(training) == set(TRAIN_LAYOUTS), training
    bad = {f"{layout}: {k}": v for layout, e in training.items() for k, v in e.items() if not v <= 1e-5}
    assert not bad, training


# ---- the worker (under torchrun) -------------------------------------------------------------------
def _compare(sp: bool) -> dict[str, float]:
    import copy

    import torch.distributed as dist

    from tessera.common.layout import ParallelLayout
    from tessera.common.models import registry
    from tessera.common.models.encoder.parallelize import parallelize_model
    from tessera.common.parallel.layers import shard_dim_of
    from tessera.common.parallel.state import build_groups

    groups = build_groups(ParallelLayout(tensor=2))
    cfg = registry.model_config(MODEL)
    whole = registry.kind_of(cfg).build(cfg, seed=0)
    with torch.no_grad():  # biases and norms at random too, so a dropped slice shows
        g = torch.Generator().manual_seed(1)
        for p in whole.parameters():
            if p.ndim == 1:
                p.normal_(0.5, 0.3, generator=g)
    part = parallelize_model(copy.deepcopy(whole), groups, sequence_parallel=sp)
    exact = copy.deepcopy(whole).double()
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, MODEL["vocab_size"], (3, 16), generator=g)
    types = (torch.arange(16) >= 9).long().expand(3, 16)
    mask = torch.ones(3, 16, dtype=torch.long)
    mask[1, 11:] = 0
    w_hidden = torch.randn(3, 16, 32, generator=g)
    w_pooled, w_binary = torch.randn(3, 32, generator=g), torch.randn(3, 2, generator=g)
    rank, world = groups.tp_rank, groups.tp
    errors: dict[str, float] = {}
    outs = {}
    for name, model in (("whole", whole), ("part", part), ("exact", exact)):
        o = model(tokens, types, mask)
        hidden_w = w_hidden.chunk(world, dim=1)[rank] if (sp and model is part) else w_hidden
        loss = ((o.hidden * hidden_w.to(o.hidden.dtype)).sum() + (o.pooled * w_pooled.to(o.pooled.dtype)).sum()
                + (o.binary_logits * w_binary.to(o.pooled.dtype)).sum())
        loss.backward()
        outs[name] = o
    wo, po, ex = outs["whole"], outs["part"], outs["exact"]

    def mine(t: torch.Tensor, seq_dim: int | None = None) -> torch.Tensor:
        """This rank's part of a whole-model tensor (its sequence chunk under SP)."""
        return t.chunk(world, dim=seq_dim)[rank] if (sp and seq_dim is not None) else t

    def check(what: str, got: torch.Tensor, fp32: torch.Tensor, fp64: torch.Tensor) -> None:
        # The split's error against fp64, over the one process's own fp32 error against fp64 (plus
        # a floor of 1e-7 of the scale, for exactly-computed entries).
        scale = fp64.abs().max().item() + 1e-12
        errors[what] = (got.double() - fp64).abs().max().item() / (
            (fp32.double() - fp64).abs().max().item() + 1e-7 * scale)

    check("hidden", po.hidden, mine(wo.hidden, 1), mine(ex.hidden, 1))
    check("pooled", po.pooled, wo.pooled, ex.pooled)
    check("binary logits", po.binary_logits, wo.binary_logits, ex.binary_logits)
    check("mlm logits", po.mlm_logits, mine(wo.mlm_logits, 1).chunk(world, dim=-1)[rank],
          mine(ex.mlm_logits, 1).chunk(world, dim=-1)[rank])
    named, named64 = dict(whole.named_parameters()), dict(exact.named_parameters())
    for name, p in part.named_parameters():
        if name.startswith("mlm_head."):  # the MLM logits' gradient is the vocab-parallel loss's (trainer)
            assert p.grad is None and named[name].grad is None, name
            continue
        grad = p.grad.clone()
        dim = shard_dim_of(p)
        if getattr(p, "sequence_parallel_partial", False):  # as the trainer's gradient code sums them
            dist.all_reduce(grad, group=groups.tp_group)
        want, want64 = named[name].grad, named64[name].grad
        if dim is not None:
            want, want64 = want.chunk(world, dim=dim)[rank], want64.chunk(world, dim=dim)[rank]
        check(f"{name} grad", grad, want, want64)
    worst = torch.tensor(list(errors.values()))
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return dict(zip(errors, worst.tolist()))


TRAIN_LAYOUTS = {"tp2": dict(tensor=2), "tp2_sp": dict(tensor=2), "pp2": dict(pipeline=2),
                 "dp2": dict(data=2), "fsdp2": dict(data=2, data_shard=2)}
TRAIN = dict(steps=3, global_batch=8, micro_batch=2, seq=16)


def _mlm_batch(step: int):
    """An MLM batch of the whole global batch: padded rows, two segments, ~20% labelled positions
    (at least one per row), binary targets."""
    from tessera.trainer.documents import IGNORE_INDEX
    from tessera.trainer.mlm.batches import MLMBatch

    b, t = TRAIN["global_batch"], TRAIN["seq"]
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, MODEL["vocab_size"], (b, t), generator=g)
    lengths = torch.randint(t // 2, t + 1, (b,), generator=g)
    padding = (torch.arange(t)[None] < lengths[:, None]).long()
    types = ((torch.arange(t)[None] >= (lengths[:, None] // 2)) & padding.bool()).long()
    picked = (torch.rand(b, t, generator=g) < 0.2) & padding.bool()
    picked[:, 1] = True
    labels = torch.where(picked, torch.randint(0, MODEL["vocab_size"], (b, t), generator=g), IGNORE_INDEX)
    return MLMBatch(tokens, types, padding, torch.randint(0, 2, (b,), generator=g)), labels


def _reference_training(cfg):
    """One process: the plain model, torch's AdamW (no decay on vectors), clipping; the batch loss
    the mean of the micro-batches' MLM (+ binary) losses, as MLMStep takes it."""
    from tessera.common.models import registry
    from tessera.trainer.mlm.loss import mlm_loss

    sys.path.insert(0, str(Path(__file__).parent))
    from parallel_harness import OPTIM, reference_optimizer

    model = registry.kind_of(cfg).build(cfg, seed=0)
    opt = reference_optimizer(model)
    mb, n = TRAIN["micro_batch"], TRAIN["global_batch"] // TRAIN["micro_batch"]
    losses = []
    for step in range(TRAIN["steps"]):
        batch, labels = _mlm_batch(step)
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for i in range(n):
            rows = slice(i * mb, (i + 1) * mb)
            part = batch[rows]
            out = model(part.tokens, part.token_types, part.padding_mask)
            loss = mlm_loss(out, labels[rows], part.binary_labels) / n
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), OPTIM["grad_clip"])
        opt.step()
        losses.append(total)
    return losses, dict(model.named_parameters())


def _train_parity(name: str, layout_kw: dict, cfg, reference) -> dict[str, float]:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from tessera.common.layout import ParallelLayout
    from tessera.common.models import registry
    from tessera.common.parallel.layers import shard_dim_of
    from tessera.common.parallel.state import build_groups, set_groups
    from tessera.trainer.kinds import parallel_objective
    from tessera.trainer.parallel.runtime import ParallelRuntime

    sys.path.insert(0, str(Path(__file__).parent))
    from parallel_harness import OPTIM

    from tessera.trainer.config import OptimConfig, ParallelConfig, TrainingConfig

    layout = ParallelLayout(**layout_kw)
    groups = build_groups(layout)
    set_groups(groups)
    training = TrainingConfig(seq_length=TRAIN["seq"], global_batch_size=TRAIN["global_batch"],
                              micro_batch_size=TRAIN["micro_batch"])
    parallel = ParallelConfig(**layout.model_dump(exclude={"data"}), sequence_parallel=name == "tp2_sp")
    rt = ParallelRuntime.build(cfg, groups, training, parallel, OptimConfig(**OPTIM),
                               build_model=lambda: registry.kind_of(cfg).build(cfg, seed=0),
                               objective=parallel_objective(cfg))
    ref_losses, ref_params = reference
    rows = TRAIN["global_batch"] // groups.dp_ep
    mine = slice(groups.dp_ep_rank * rows, (groups.dp_ep_rank + 1) * rows)
    errors = {}
    for step in range(TRAIN["steps"]):
        batch, labels = _mlm_batch(step)
        loss = rt.train_step(batch[mine], labels[mine]).loss
        errors[f"step {step} loss"] = abs(loss - ref_losses[step]) / abs(ref_losses[step])
    diff = torch.zeros((), dtype=torch.float64)
    norm = torch.zeros((), dtype=torch.float64)
    for pname, p in rt.named_global_params().items():
        got = p.data.full_tensor() if isinstance(p.data, DTensor) else p.data
        want = ref_params[pname].detach()
        dim = shard_dim_of(p)
        if groups.tp > 1 and dim is not None:
            want = want.chunk(groups.tp, dim=dim)[groups.tp_rank]
        diff += (got.double() - want.double()).pow(2).sum()
        norm += want.double().pow(2).sum()
    errors["params after steps (normwise)"] = float((diff / norm).sqrt())
    worst = torch.tensor(list(errors.values()))
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return dict(zip(errors, worst.tolist()))


def _main() -> None:
    from tessera.common.parallel.state import destroy_distributed, init_distributed

    torch.set_num_threads(1)
    init_distributed()
    errors = {"tp2": _compare(sp=False), "tp2_sp": _compare(sp=True)}
    from tessera.common.models import registry

    cfg = registry.model_config(MODEL)
    reference = _reference_training(cfg)
    errors["training"] = {name: _train_parity(name, kw, cfg, reference) for name, kw in TRAIN_LAYOUTS.items()}
    if torch.distributed.get_rank() == 0:
        Path(sys.argv[1]).write_text(json.dumps(errors))
    destroy_distributed()


if __name__ == "__main__":
    _main()
