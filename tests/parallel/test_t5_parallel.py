"""The encoder-decoder's (T5's) tensor-parallel plan computes what the whole model does: TP2 and
TP2 with sequence parallel on gloo, fp32, the same weights and a padded batch, for T5 (tied, scaled
head) and v1.1 (gated GELU, its own head): the decoder's hidden states, the rank's vocabulary slice
of the logits, the vocab-parallel cross-entropy, and the gradient of every parameter (the rank's
slice of the whole one's; a sequence-parallel partial gradient summed over the tensor group first).

Training under the parallel runtime (the span-corruption objective, tessera.trainer.span.objective):
TP2, TP2+SP, DP2 and FSDP2 take the same losses and reach the same parameters as one process with
torch's AdamW after a few optimizer steps, for both variants (T5's tied, scaled head; v1.1's own).

One torchrun launch runs every layout: this file is also the worker (`torchrun ... this_file out.json`).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

MODEL = dict(kind="encoder_decoder", vocab_size=64, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=2,
             num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=16)
VARIANTS = {"t5": dict(feed_forward="relu", tie_word_embeddings=True),
            "v1_1": dict(feed_forward="gated-gelu", tie_word_embeddings=False)}
# The split may reorder fp32 sums: its error against an fp64 run of the whole model is held to
# TOL times the one process's own fp32 error against that run.
TOL = 10.0


@pytest.mark.distributed
def test_t5_under_tp2_and_sp_computes_what_the_whole_model_does_and_trains_under_tp_sp_dp_fsdp_like_one_process(tmp_path):
    import subprocess

    out = tmp_path / "errors.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", __file__, str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    errors = json.loads(out.read_text())
    training = errors.pop("training")
    assert set(errors) == {f"{v} {layout}" for v in VARIANTS for layout in ("tp2", "tp2_sp")}
    assert all(len(e) > 40 for e in errors.values())
    bad = {f"{layout}: {k}": v for layout, e in errors.items() for k, v in e.items() if not v <= TOL}
    assert not bad, bad
    # Span-corruption training: per-step losses within 1e-5 relative, parameters after the steps
    # within 1e-5 normwise (each rank's shards against the one process's).
    assert set(training) == {f"{v} {layout}" for v in VARIANTS for layout in TRAIN_LAYOUTS}, training
    assert all(len(e) == TRAIN["steps"] + 1 for e in training.values()), training
    bad = {f"{layout}: {k}": v for layout, e in training.items() for k, v in e.items() if not v <= 1e-5}
    assert not bad, training


# ---- the worker (under torchrun) -------------------------------------------------------------------
def _compare(variant: str, sp: bool) -> dict[str, float]:
    import copy

    import torch.distributed as dist
    import torch.nn.functional as F

    from tessera.common.layout import ParallelLayout
    from tessera.common.models import registry
    from tessera.common.models.encoder_decoder.parallelize import parallel_logits, parallelize_model
    from tessera.common.parallel.layers import shard_dim_of
    from tessera.common.parallel.loss import vocab_parallel_cross_entropy
    from tessera.common.parallel.state import build_groups

    groups = build_groups(ParallelLayout(tensor=2))
    cfg = registry.model_config({**MODEL, **VARIANTS[variant]})
    whole = registry.kind_of(cfg).build(cfg, seed=0)
    with torch.no_grad():  # norms at random too, so a dropped slice shows
        g = torch.Generator().manual_seed(1)
        for p in whole.parameters():
            if p.ndim == 1:
                p.normal_(1.0, 0.3, generator=g)
    part = parallelize_model(copy.deepcopy(whole), groups, sequence_parallel=sp)
    exact = copy.deepcopy(whole).double()
    g = torch.Generator().manual_seed(2)
    tokens, dec = torch.randint(0, 64, (3, 12), generator=g), torch.randint(0, 64, (3, 8), generator=g)
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[1, 9:] = 0
    labels = torch.randint(0, 64, (3, 8), generator=g)
    labels[2, 6:] = -100
    rank, world = groups.tp_rank, groups.tp
    errors: dict[str, float] = {}
    outs = {}
    for name, model in (("whole", whole), ("part", part), ("exact", exact)):
        hidden = model.hidden(tokens, decoder_input_ids=dec, attention_mask=mask)
        if model is part:
            logits = parallel_logits(model, hidden)
            per_token = vocab_parallel_cross_entropy(logits.float(), labels.clamp(min=0), groups.tp_group)
            loss = (per_token * (labels != -100)).sum() / (labels != -100).sum()
        else:
            logits = model.head(hidden)
            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        loss.backward()
        outs[name] = (hidden, logits, loss)

    def mine(t: torch.Tensor, seq_dim: int | None = None) -> torch.Tensor:
        return t.chunk(world, dim=seq_dim)[rank] if (sp and seq_dim is not None) else t

    def check(what: str, got: torch.Tensor, fp32: torch.Tensor, fp64: torch.Tensor) -> None:
        scale = fp64.abs().max().item() + 1e-12
        errors[what] = (got.double() - fp64).abs().max().item() / (
            (fp32.double() - fp64).abs().max().item() + 1e-7 * scale)

    (wh, wl, wloss), (ph, pl, ploss), (eh, el, eloss) = outs["whole"], outs["part"], outs["exact"]
    check("decoder hidden", ph, mine(wh, 1), mine(eh, 1))
    check("logits", pl, wl.chunk(world, dim=-1)[rank], el.chunk(world, dim=-1)[rank])
    check("loss", ploss, wloss, eloss)
    named, named64 = dict(whole.named_parameters()), dict(exact.named_parameters())
    for name, p in part.named_parameters():
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


TRAIN_LAYOUTS = {"tp2": dict(tensor=2), "tp2_sp": dict(tensor=2), "dp2": dict(data=2),
                 "fsdp2": dict(data=2, data_shard=2)}
TRAIN = dict(steps=3, global_batch=8, micro_batch=2, seq=12, decoder_seq=8)


def _span_batch(step: int):
    """A span-corruption batch of the whole global batch: padded encoder rows, decoder inputs, and
    targets with -100 on the padding of shorter rows (at least one counted target per row)."""
    from tessera.trainer.span.batches import SpanBatch

    b, t, d = TRAIN["global_batch"], TRAIN["seq"], TRAIN["decoder_seq"]
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, MODEL["vocab_size"], (b, t), generator=g)
    lengths = torch.randint(t // 2, t + 1, (b,), generator=g)
    padding = (torch.arange(t)[None] < lengths[:, None]).long()
    labels = torch.randint(0, MODEL["vocab_size"], (b, d), generator=g)
    targets = torch.randint(2, d + 1, (b,), generator=g)
    labels = labels.masked_fill(torch.arange(d)[None] >= targets[:, None], -100)
    decoder = torch.cat([torch.zeros(b, 1, dtype=torch.long), labels[:, :-1].clamp(min=0)], dim=1)
    return SpanBatch(tokens, padding, decoder), labels


def _reference_training(cfg):
    """One process: the plain model, torch's AdamW, clipping; the batch loss the mean of the
    micro-batches' mean target cross-entropies, as SpanStep takes it."""
    import torch.nn.functional as F

    from tessera.common.models import registry

    sys.path.insert(0, str(Path(__file__).parent))
    from parallel_harness import OPTIM, reference_optimizer

    model = registry.kind_of(cfg).build(cfg, seed=0)
    opt = reference_optimizer(model)
    mb, n = TRAIN["micro_batch"], TRAIN["global_batch"] // TRAIN["micro_batch"]
    losses = []
    for step in range(TRAIN["steps"]):
        batch, labels = _span_batch(step)
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for i in range(n):
            rows = slice(i * mb, (i + 1) * mb)
            part = batch[rows]
            logits = model.head(model.hidden(part.tokens, decoder_input_ids=part.decoder_tokens,
                                             attention_mask=part.padding_mask))
            loss = F.cross_entropy(logits.flatten(0, 1), labels[rows].flatten(), ignore_index=-100) / n
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
    from tessera.trainer.config import OptimConfig, ParallelConfig, TrainingConfig
    from tessera.trainer.kinds import parallel_objective
    from tessera.trainer.parallel.runtime import ParallelRuntime

    sys.path.insert(0, str(Path(__file__).parent))
    from parallel_harness import OPTIM

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
        batch, labels = _span_batch(step)
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
    errors = {f"{v} {name}": _compare(v, sp) for v in VARIANTS for name, sp in (("tp2", False), ("tp2_sp", True))}
    from tessera.common.models import registry

    errors["training"] = {}
    for v in VARIANTS:
        cfg = registry.model_config({**MODEL, **VARIANTS[v]})
        reference = _reference_training(cfg)
        errors["training"].update({f"{v} {name}": _train_parity(name, kw, cfg, reference)
                                   for name, kw in TRAIN_LAYOUTS.items()})
    if torch.distributed.get_rank() == 0:
        Path(sys.argv[1]).write_text(json.dumps(errors))
    destroy_distributed()


if __name__ == "__main__":
    _main()
