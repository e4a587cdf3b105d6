"""Parity of hybrid (Mamba-2 + attention + MLP + MoE) models under the parallel engine: TP2, TP2 with
sequence parallel, PP2 cut mid-pattern, DP2, FSDP2, EP2, CP2 (also over packed documents) and TP2 x
CP2 with sequence parallel over packed documents (four processes) train like one process (gloo/CPU, fp32:
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

from tessera.common.checkpoint import load_model_tensors  # noqa: E402
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
# meta: built on the meta device, only the rank's shards allocated and initialised (sharded_init);
# save: the final weights go to a layout-free DCP checkpoint, compared with the one process's.
JOBS = {
    "tp2": dict(layout=dict(tensor=2), training=dict(micro_batch_size=4), parallel=dict(sequence_parallel=False)),
    "tp2_sp_meta": dict(layout=dict(tensor=2), training=dict(micro_batch_size=4), parallel=dict(sequence_parallel=True),
                        meta=True, save=True),
    "tp2_sp_documents": dict(layout=dict(tensor=2), training=dict(micro_batch_size=4),
                             parallel=dict(sequence_parallel=True), documents=True),
    "pp2_meta": dict(layout=dict(pipeline=2), training=dict(micro_batch_size=2), meta=True),
    "dp2": dict(layout=dict(data=2), training=dict(micro_batch_size=2)),
    "fsdp2": dict(layout=dict(data=2, data_shard=2), training=dict(micro_batch_size=2), save=True),
    "ep2": dict(layout=dict(expert=2), training=dict(micro_batch_size=2)),
    # Context parallel: attention over all-gathered keys/values, each Mamba layer over the whole
    # sequence of half its heads and groups (all-to-all there and back); with packed documents too.
    "cp2": dict(layout=dict(context=2), training=dict(micro_batch_size=4)),
    "cp2_documents": dict(layout=dict(context=2), training=dict(micro_batch_size=4), documents=True),
}
# Four processes, one more launch: context parallel within tensor parallel with sequence parallel
# (each Mamba layer's rank-local heads split again over the context ranks), packed documents.
FOUR_RANK_JOBS = {
    "tp2_sp_cp2_documents": dict(layout=dict(tensor=2, context=2), training=dict(micro_batch_size=4),
                                 parallel=dict(sequence_parallel=True), documents=True,
                                 model=dict(mamba={**MODEL["mamba"], "num_groups": 4})),  # a group per rank
}


def hybrid_config(**over) -> HybridConfig:
    return HybridConfig.model_validate({**MODEL, **over})


def reference(cfg: HybridConfig, documents: bool) -> tuple[list[float], list[float], torch.nn.Module]:
    """Losses, pre-clip gradient norms and the trained model of STEPS one-process steps (AdamW,
    clipping) on the harness's batches: the whole global batch at once."""
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
    return losses, norms, model


def _close(got: list[float], want: list[float], rtol: float, what: str) -> None:
    assert len(got) == len(want), what
    for i, (g, w) in enumerate(zip(got, want)):
        assert abs(g - w) <= rtol * abs(w), f"{what}: step {i}: {g} vs one process {w}"


def _torchrun(spec: dict, tmp: Path, nproc: int = 2) -> None:
    import subprocess

    spec_path = tmp / f"spec{nproc}.json"
    spec_path.write_text(json.dumps(spec))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", __file__,
           str(spec_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]


@pytest.mark.slow
@pytest.mark.distributed
def test_a_hybrid_model_trains_under_tp_sp_pp_dp_fsdp_ep_and_cp_like_one_process_and_its_mixer_splits_exactly(tmp_path):
    torch.set_num_threads(1)
    jobs = [{**j, "name": n, "out": str(tmp_path / f"{n}.json"),
             "save": str(tmp_path / f"{n}.ckpt") if j.get("save") else None} for n, j in JOBS.items()]
    jobs.append({"kind": "mixer", "name": "mixer", "out": str(tmp_path / "mixer.json")})
    _torchrun({"jobs": jobs}, tmp_path)
    _torchrun({"jobs": [{**j, "name": n, "out": str(tmp_path / f"{n}.json"), "save": None}
                        for n, j in FOUR_RANK_JOBS.items()]}, tmp_path, nproc=4)
    cfg = hybrid_config()
    plain, documents = reference(cfg, False), reference(cfg, True)
    for name, job in {**JOBS, **FOUR_RANK_JOBS}.items():
        out = json.loads((tmp_path / f"{name}.json").read_text())
        if "model" in job:
            want_losses, want_norms, model = reference(hybrid_config(**job["model"]), job.get("documents", False))
        else:
            want_losses, want_norms, model = documents if job.get("documents") else plain
        _close(out["losses"], want_losses, LOSS_RTOL, f"{name} loss")
        _close(out["grad_norms"], want_norms, NORM_RTOL, f"{name} grad norm")
        assert out["divergence"] == [0.0, 0.0], f"{name}: replicas diverged {out['divergence']}"
        if job.get("save"):  # global tensors under the one-process names (each rank's heads in place)
            stored = load_model_tensors(tmp_path / f"{name}.ckpt")
            want = {n: t.detach() for n, t in model.state_dict().items()}  # the MoE bias buffer too
            assert stored.keys() == want.keys(), f"{name}: {sorted(stored.keys() ^ want.keys())[:4]}"
            diff = sum((stored[n] - w).pow(2).sum().item() for n, w in want.items()) ** 0.5
            norm = sum(w.pow(2).sum().item() for w in want.values()) ** 0.5
            assert diff / norm <= LOSS_RTOL, f"{name}: weights {diff / norm:.2e} from the one process's"
    mixer = json.loads((tmp_path / "mixer.json").read_text())
    for what, err in mixer.items():
        assert err <= 1e-5, f"tensor-parallel mixer: {what} differs from the whole mixer by {err:.2e}"


@pytest.mark.parametrize(("over", "layout", "field"), [
    (dict(mamba={**MODEL["mamba"], "num_heads": 3, "num_groups": 3}), dict(tensor=2), "model.mamba.num_heads (3)"),
    (dict(mamba={**MODEL["mamba"], "num_groups": 1}), dict(tensor=2), "model.mamba.num_groups (1)"),
    (dict(mamba={**MODEL["mamba"], "num_groups": 2}), dict(context=2, tensor=2),
     "--context-parallel 2 x --tensor-parallel 2 must divide model.mamba.num_groups (2)"),
])
def test_a_layout_a_hybrid_model_cannot_split_is_refused_in_one_line_naming_the_field(over, layout, field):
    with pytest.raises(UserError) as exc:
        validate_layout(hybrid_config(**over), ParallelLayout(**layout))
    assert field in str(exc.value) and "\n" not in str(exc.value)


@pytest.mark.slow
@pytest.mark.distributed
def test_tessera_train_trains_a_hybrid_config_under_tensor_and_sequence_parallel_like_one_process(tmp_path):
    """The trainer end to end on a real mixture, packed documents (attention within each, the
    Mamba state restarted at each): `torchrun ... tessera.trainer --tensor-parallel 2` (sequence
    parallel on by default; the model built on the meta device, only each rank's shards
    initialised) logs the one-process losses (1e-5) and gradient norms (1e-4)."""
    import subprocess

    import yaml

    sys.path.insert(0, str(HERE.parent / "trainer"))
    from trainer_fixtures import build_mixture

    from tessera.trainer.cli import main

    data = build_mixture(tmp_path / "data", seq_length=32, vocab_size=384)
    model = {"kind": "hybrid", **{k: v for k, v in MODEL.items() if k != "vocab_size"}, "max_seq_len": 64}

    def config(name: str) -> Path:
        cfg = {"run_dir": str(tmp_path / name), "model": model,
               "data": {"mixture": str(data["mixture"]), "tokenizer": str(data["tokenizer"]),
                        "reset_attention_mask": True, "eod_mask_loss": True},
               "optim": {"lr": 3e-3, "min_lr": 3e-4, "grad_clip": 0.5},
               "training": {"global_batch_size": 8, "micro_batch_size": 2, "seq_length": 32, "steps": STEPS,
                            "log_interval": 1, "eval_interval": 0, "threads": 1},
               "logging": {"tensorboard": False}}
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(cfg))
        return tmp_path / f"{name}.yaml"

    def logged(name: str) -> tuple[list[float], list[float]]:
        rows = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        rows = [r for r in rows if r["kind"] == "train"]
        return [r["loss"] for r in rows], [r["grad_norm"] for r in rows]

    assert main(["--config", str(config("one")), "--quiet"]) == 0
    cmd = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc-per-node=2", "-m", "tessera.trainer",
           "--config", str(config("tp2")), "--quiet", "--tensor-parallel", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    (want_losses, want_norms), (losses, norms) = logged("one"), logged("tp2")
    _close(losses, want_losses, LOSS_RTOL, "tessera-train tp2 loss")
    _close(norms, want_norms, NORM_RTOL, "tessera-train tp2 grad norm")


def test_tessera_plan_refuses_a_tensor_size_that_splits_a_mamba_group_in_one_line(tmp_path):
    import subprocess

    import yaml

    model = {"kind": "hybrid", **MODEL, "mamba": {**MODEL["mamba"], "num_groups": 1}}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(
        {"model": model, "training": {"seq_length": 16, "micro_batch_size": 2, "global_batch_size": 8}}))
    proc = subprocess.run([sys.executable, "-m", "tessera.trainer.plan.cli", "--config", str(tmp_path / "run.yaml"),
                           "--tensor-parallel", "2"], capture_output=True, text=True)
    lines = [ln for ln in proc.stderr.splitlines() if "Warning" not in ln and "_conversion_method" not in ln]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "--tensor-parallel 2 must divide model.mamba.num_groups (1)" in lines[0]


# ---- the worker (under torchrun) -------------------------------------------------------------------
def _train_job(job: dict) -> None:
    from tessera.common.models.hybrid.model import build_model
    from tessera.common.parallel.state import build_groups
    from tessera.trainer.parallel.runtime import ParallelRuntime

    cfg = hybrid_config(**job.get("model", {}))
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
    if job.get("save"):
        rt.save(job["save"])
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
    # 4 groups: two per rank, so a gated norm over the rank's whole width (not per group) would show.
    m = hybrid_config(mamba={**MODEL["mamba"], "num_groups": 4, "bias": True}).mamba
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
