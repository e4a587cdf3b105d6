"""The vision-language (LLaVA) tensor-parallel plan computes what the whole model does: TP2 and TP2
with sequence parallel on gloo, fp32, the same weights, two images in a batch of three rows (one
row without an image): the language model's hidden states, the logits (the rank's vocabulary
slice) and the gradient of every parameter (the rank's slice of the whole one's; a sequence-
parallel partial gradient summed over the tensor group first), for a CLIP + Llama model.

One torchrun launch runs both layouts: this file is also the worker (`torchrun ... this_file out.json`).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

IMAGE_TOKEN = 60
TEXT = dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_hidden_size=64,
            max_seq_len=32, tie_embeddings=False)
VISION = dict(arch="clip", hidden_size=24, num_layers=2, num_heads=4, ffn_hidden_size=48, image_size=16, patch_size=8)
MODEL = dict(kind="vision_language", vision=VISION, text=TEXT, image_token_id=IMAGE_TOKEN, vision_feature_layer=-2)
# The split may reorder fp32 sums: its error against an fp64 run of the whole model is held to
# TOL times the one process's own fp32 error against that run.
TOL = 10.0


@pytest.mark.distributed
def test_llava_under_tp2_and_sp_computes_the_whole_models_logits_and_every_gradient(tmp_path):
    import subprocess

    out = tmp_path / "errors.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", __file__, str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    errors = json.loads(out.read_text())
    assert set(errors) == {"tp2", "tp2_sp"} and all(len(e) > 30 for e in errors.values()), errors
    bad = {f"{layout}: {k}": v for layout, e in errors.items() for k, v in e.items() if not v <= TOL}
    assert not bad, bad


# ---- the worker (under torchrun) -------------------------------------------------------------------
def _compare(sp: bool) -> dict[str, float]:
    import copy

    import torch.distributed as dist

    from tessera.common.layout import ParallelLayout
    from tessera.common.models import registry
    from tessera.common.parallel.layers import shard_dim_of
    from tessera.common.parallel.state import build_groups
    from tessera.common.parallel.tensor_parallel import parallel_logits

    groups = build_groups(ParallelLayout(tensor=2))
    cfg = registry.model_config(MODEL)
    kind = registry.kind_of(cfg)
    whole = kind.build(cfg, seed=0)
    with torch.no_grad():  # biases and norms at random too, so a dropped slice shows
        g = torch.Generator().manual_seed(1)
        for p in whole.parameters():
            if p.ndim == 1:
                p.normal_(0.5, 0.3, generator=g)
    part = kind.parallel().tensor(copy.deepcopy(whole), groups, sp)
    exact = copy.deepcopy(whole).double()
    g = torch.Generator().manual_seed(2)
    seq, n_feat = 16, cfg.image_seq_len
    tokens = torch.randint(0, IMAGE_TOKEN, (3, seq), generator=g)
    tokens[0, 2:2 + n_feat] = IMAGE_TOKEN
    tokens[2, 5:5 + n_feat] = IMAGE_TOKEN
    pixels = torch.randn(2, 3, 16, 16, generator=g)
    w_hidden = torch.randn(3, seq, TEXT["hidden_size"], generator=g)
    w_logits = torch.randn(3, seq, TEXT["vocab_size"], generator=g)
    rank, world = groups.tp_rank, groups.tp
    errors: dict[str, float] = {}
    outs = {}
    for name, model in (("whole", whole), ("part", part), ("exact", exact)):
        dt = torch.float64 if model is exact else torch.float32
        hidden = model(tokens, pixels.to(dt), return_hidden=True)
        if model is part:  # the head as the trainer runs it: local vocabulary, whole sequence
            lm = part.language_model
            logits = parallel_logits(model(tokens, pixels, return_hidden=True), lm.output_weight(), lm)
        else:
            logits = model(tokens, pixels.to(dt))
        hw = w_hidden.chunk(world, dim=1)[rank] if (sp and model is part) else w_hidden
        lw = w_logits.chunk(world, dim=-1)[rank] if model is part else w_logits
        ((hidden * hw.to(dt)).sum() + (logits * lw.to(dt)).sum()).backward()
        outs[name] = (hidden, logits)

    def check(what: str, got: torch.Tensor, fp32: torch.Tensor, fp64: torch.Tensor) -> None:
        scale = fp64.abs().max().item() + 1e-12
        errors[what] = (got.double() - fp64).abs().max().item() / (
            (fp32.double() - fp64).abs().max().item() + 1e-7 * scale)

    (wh, wl), (ph, pl), (eh, el) = outs["whole"], outs["part"], outs["exact"]

    def mine_seq(t: torch.Tensor) -> torch.Tensor:
        return t.chunk(world, dim=1)[rank] if sp else t

    check("hidden", ph, mine_seq(wh), mine_seq(eh))
    check("logits", pl, wl.chunk(world, dim=-1)[rank], el.chunk(world, dim=-1)[rank])
    named, named64 = dict(whole.named_parameters()), dict(exact.named_parameters())
    for name, p in part.named_parameters():
        if named[name].grad is None:  # the tower's post-norm and SigLIP's head: LLaVA does not read them
            assert p.grad is None, name
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


def _main() -> None:
    from tessera.common.parallel.state import destroy_distributed, init_distributed

    torch.set_num_threads(1)
    init_distributed()
    errors = {"tp2": _compare(sp=False), "tp2_sp": _compare(sp=True)}
    if torch.distributed.get_rank() == 0:
        Path(sys.argv[1]).write_text(json.dumps(errors))
    destroy_distributed()


if __name__ == "__main__":
    _main()
