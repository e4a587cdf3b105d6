"""The encoder-decoder's (T5's) tensor-parallel plan computes what the whole model does: TP2 and
TP2 with sequence parallel on gloo, fp32, the same weights and a padded batch, for T5 (tied, scaled
head) and v1.1 (gated GELU, its own head): the decoder's hidden states, the rank's vocabulary slice
of the logits, the vocab-parallel cross-entropy, and the gradient of every parameter (the rank's
slice of the whole one's; a sequence-parallel partial gradient summed over the tensor group first).

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
def test_t5_under_tp2_and_tp2_with_sequence_parallel_computes_what_the_whole_model_does(tmp_path):
    import subprocess

    out = tmp_path / "errors.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", __file__, str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    errors = json.loads(out.read_text())
    assert set(errors) == {f"{v} {layout}" for v in VARIANTS for layout in ("tp2", "tp2_sp")}
    assert all(len(e) > 40 for e in errors.values())
    bad = {f"{layout}: {k}": v for layout, e in errors.items() for k, v in e.items() if not v <= TOL}
    assert not bad, bad


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


def _main() -> None:
    from tessera.common.parallel.state import destroy_distributed, init_distributed

    torch.set_num_threads(1)
    init_distributed()
    errors = {f"{v} {name}": _compare(v, sp) for v in VARIANTS for name, sp in (("tp2", False), ("tp2_sp", True))}
    if torch.distributed.get_rank() == 0:
        Path(sys.argv[1]).write_text(json.dumps(errors))
    destroy_distributed()


if __name__ == "__main__":
    _main()
