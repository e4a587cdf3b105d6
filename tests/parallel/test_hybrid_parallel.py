"""Parity of hybrid (Mamba-2 + attention + MLP + MoE) models under the parallel engine: TP2, TP2 with
sequence parallel, PP2 cut mid-pattern, DP2, FSDP2 and EP2 train like one process (gloo/CPU, fp32:
losses within 1e-5, pre-clip gradient norms within 1e-4), and a tensor-parallel Mamba-2 mixer
computes what the whole one does, forward, backward and decoding.

One torchrun launch runs every job: this file is also the worker (`torchrun ... this_file spec.json`).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

import parallel_harness as H  # noqa: E402

from tessera.common.errors import UserError  # noqa: E402
from tessera.common.layout import ParallelLayout, validate_layout  # noqa: E402
from tessera.common.models.hybrid.config import HybridConfig  # noqa: E402

STEPS = 4
LOSS_RTOL, NORM_RTOL = 1e-5, 1e-4
# All four layer symbols; the automatic PP2 split is [3, 2]: M*- | ME, Mamba layers on both stages.
PATTERN = "M*-ME"
MODEL = dict(vocab_size=128, hidden_size=32, num_layers=len(PATTERN), pattern=PATTERN, max_seq_len=32,
             mamba=dict(num_heads=4, head_dim=8, state_size=8, num_groups=2, chunk_size=8),
             num_heads=4, num_kv_heads=2, ffn_hidden_size=64,
             moe=dict(num_experts=4, top_k=2, ffn_hidden_size=32, num_shared_experts=1, aux_loss_coef=0.0))
# meta: built on the meta device, only the rank's shards allocated and initialised (sharded_init).
JOBS = {
    "tp2": dict(layout=dict(tensor=2), training=dict(micro_batch_size=4), parallel=dict(sequence_parallel=False)),
    "tp2_sp_meta": dict(layout=dict(tensor=2), training=dict(micro_batch_size=4), parallel=dict(sequence_parallel=True),
                        meta=True),
    "tp2_sp_documents": dict(layout=dict(tensor=2), training=dict(micro_batch_size=4),
                             parallel=dict(sequence_parallel=True), documents=True),
    "pp2_meta": dict(layout=dict(pipeline=2), training=dict(micro_batch_size=2), meta=True),
    "dp2": dict(layout=dict(data=2), training=dict(micro_batch_size=2)),
    "fsdp2": dict(layout=dict(data=2, data_shard=2), training=dict(micro_batch_size=2)),
    "ep2": dict(layout=dict(expert=2), training=dict(micro_batch_size=2)),
}


def hybrid_config(**over) -> HybridConfig:
    return HybridConfig.model_validate({**MODEL, **over})


def reference(cfg: HybridConfig, documents: bool) -> tuple[list[float], list[float]]:
    """Losses and pre-clip gradient norms of STEPS one-process steps (AdamW, clipping) on the
    harness's batches: the whole global batch at once."""
    from tessera.common.models.hybrid.model import build_model

    torch.manual_seed(0)
    model = build_model(cfg, seed=H.MODEL_SEED)
    opt = H.reference_optimizer(model)
    losses, norms = [], []
    for step in range(STEPS):
        if documents:
            tokens, targets, inputs = H.documents_batch(step, cfg)
            inputs = {"document_ids": inputs["document_ids"]}  # no positions: the Mamba layers carry order
        else:
            (tokens, targets), inputs = H.batch(step, cfg), {}
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(tokens, **inputs).reshape(-1, cfg.vocab_size), targets.reshape(-1))
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), H.OPTIM["grad_clip"]).item())
        opt.step()
        losses.append(loss.item())
    return losses, norms


def _close(got: list[float], want: list[float], rtol: float, what: str) -> None:
    assert len(got) == len(want), what
    for i, (g, w) in enumerate(zip(got, want)):
        assert abs(g - w) <= rtol * abs(w), f"{what}: step {i}: {g} vs one process {w}"


def _torchrun(spec: dict, tmp: Path) -> None:
    import subprocess

    spec_path = tmp / "spec.json"
    spec_path.write_text(json.dumps(spec))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", __file__,
           str(spec_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]


@pytest.mark.slow
@pytest.mark.distributed
def test_a_hybrid_model_trains_under_tp_sp_pp_dp_fsdp_and_ep_like_one_process_and_its_mixer_splits_exactly(tmp_path):
    torch.set_num_threads(1)
    jobs = [{**j, "name": n, "out": str(tmp_path / f"{n}.json")} for n, j in JOBS.items()]
    jobs.append({"kind": "mixer", "name": "mixer", "out": str(tmp_path / "mixer.json")})
    _torchrun({"jobs": jobs}, tmp_path)
    cfg = hybrid_config()
    plain, documents = reference(cfg, False), reference(cfg, True)
    for name, job in JOBS.items():
        out = json.loads((tmp_path / f"{name}.json").read_text())
        want_losses, want_norms = documents if job.get("documents") else plain
        _close(out["losses"], want_losses, LOSS_RTOL, f"{name} loss")
        _close(out["grad_norms"], want_norms, NORM_RTOL, f"{name} grad norm")
        assert out["divergence"] == [0.0, 0.0], f"{name}: replicas diverged {out['divergence']}"
    mixer = json.loads((tmp_path / "mixer.json").read_text())
    for what, err in mixer.items():
        assert err <= 1e-5, f"tensor-parallel mixer: {what} differs from the whole mixer by {err:.2e}"


@pytest.mark.parametrize(("over", "layout", "field"), [
    (dict(mamba={**MODEL["mamba"], "num_heads": 3, "num_groups": 3}), dict(tensor=2), "model.mamba.num_heads (3)"),
    (dict(mamba={**MODEL["mamba"], "num_groups": 1}), dict(tensor=2), "model.mamba.num_groups (1)"),
    ({}, dict(context=2), "--context-parallel 2 (parallel.context)"),
])
def test_a_layout_a_hybrid_model_cannot_split_is_refused_in_one_line_naming_the_field(over, layout, field):
    with pytest.raises(UserError) as exc:
        validate_layout(hybrid_config(**over), ParallelLayout(**layout))
    assert field in str(exc.value) and "\n" not in str(exc.value)


# ---- the worker (under torchrun) -------------------------------------------------------------------
def _train_job(job: dict) -> None:
    from tessera.common.models.hybrid.model import build_model
    from tessera.common.parallel.state import build_groups
    from tessera.trainer.parallel.runtime import ParallelRuntime

    cfg = hybrid_config()
    layout = ParallelLayout(**job["layout"])
    groups = build_groups(layout)
    training, parallel, optim = H.sections(layout, {"seed": H.MODEL_SEED, **job["training"]}, job.get("parallel"))
    documents = job.get("documents", False)
    if job.get("meta"):
        def builder():
            return build_model(cfg, device="meta", seed=None)
    else:
        def builder():
            return build_model(cfg, seed=H.MODEL_SEED)
    rt = ParallelRuntime.build(cfg, groups, training, parallel, optim, build_model=builder, per_token_loss=documents)
    divergence = [rt.replica_divergence()]
    rows = H.GLOBAL_BATCH // groups.dp_ep
    sl = slice(groups.dp_ep_rank * rows, (groups.dp_ep_rank + 1) * rows)
    losses, norms = [], []
    for step in range(STEPS):
        if documents:
            tokens, targets, inputs = H.documents_batch(step, cfg)
            inputs = {"document_ids": inputs["document_ids"][sl]}
        else:
            (tokens, targets), inputs = H.batch(step, cfg), {}
        r = rt.train_step(tokens[sl], targets[sl], model_inputs=inputs)
        losses.append(r.loss)
        norms.append(r.grad_norm)
    divergence.append(rt.replica_divergence())
    if groups.rank == 0:
        Path(job["out"]).write_text(json.dumps({"losses": losses, "grad_norms": norms, "divergence": divergence}))
    torch.distributed.barrier()


def _mixer_job(job: dict) -> None:
    """The whole mixer and its tensor-parallel split (2 ranks), same weights and inputs: outputs,
    input gradients and every parameter's gradient (the rank's slice of the whole one's), then a
    chunked prefill carrying the state and one decoding step from it."""
    import copy

    from tessera.common.models.hybrid.mamba import MambaMixer
    from tessera.common.models.hybrid.parallelize import split_mixer
    from tessera.common.parallel.layers import shard_dim_of
    from tessera.common.parallel.state import build_groups

    groups = build_groups(ParallelLayout(tensor=2))
    m = hybrid_config(mamba={**MODEL["mamba"], "bias": True}).mamba
    whole = MambaMixer(m, 32, 1e-5)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in whole.parameters():  # all random, norm and biases included, so no slice hides
            p.normal_(0.0, 0.3, generator=g)
        whole.reset_ssm_parameters(g)
    part = copy.deepcopy(whole)
    split_mixer(part, groups, sp=False)
    x = torch.randn(2, 16, 32, generator=g)
    doc = torch.tensor([[0] * 5 + [1] * 11, [0] * 16])
    errors = {}
    outs = []
    for mixer in (whole, part):
        xi = x.clone().requires_grad_(True)
        y = mixer(xi, doc)
        (y * torch.linspace(-1, 1, 32)).sum().backward()
        outs.append((y.detach(), xi.grad))
    errors["output"] = (outs[0][0] - outs[1][0]).abs().max().item()
    errors["input grad"] = (outs[0][1] - outs[1][1]).abs().max().item()
    named = dict(whole.named_parameters())
    for name, p in part.named_parameters():
        want = named[name].grad
        dim = shard_dim_of(p)
        if dim is not None:
            want = want.chunk(groups.tp, dim=dim)[groups.tp_rank]
        errors[f"{name} grad"] = (p.grad - want).abs().max().item()
    with torch.no_grad():  # prefill 12 tokens in two chunks, then decode one
        ys = []
        for mixer in (whole, part):
            state = mixer.new_state(2, torch.float32)
            mixer(x[:, :7], None, state)
            mixer(x[:, 7:12], None, state)
            ys.append(mixer.step(x[:, 12], state))
        errors["decoding step"] = (ys[0] - ys[1]).abs().max().item()
    worst = torch.tensor(list(errors.values()))
    torch.distributed.all_reduce(worst, op=torch.distributed.ReduceOp.MAX)
    if groups.rank == 0:
        Path(job["out"]).write_text(json.dumps(dict(zip(errors, worst.tolist()))))
    torch.distributed.barrier()


def _main() -> None:
    from tessera.common.parallel.state import destroy_distributed, init_distributed

    torch.set_num_threads(1)
    spec = json.loads(Path(sys.argv[1]).read_text())
    init_distributed()
    for job in spec["jobs"]:
        (_mixer_job if job.get("kind") == "mixer" else _train_job)(job)
    destroy_distributed()


if __name__ == "__main__":
    _main()
