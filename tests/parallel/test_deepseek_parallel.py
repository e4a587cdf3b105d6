"""Parity of a tiny DeepSeek-V3 (latent attention with the query bottleneck, group-limited sigmoid
routing with the balancing bias, a dense first layer, one multi-token-prediction depth) under the
parallel engine: TP2 (latent attention split as Megatron splits it), TP2 with sequence parallel,
EP2, FSDP2 and PP2 (MTP on the last stage, its embedding copy kept in step with the first's), all
with one MTP depth, and CP2 without it (refused with it), train like one process (gloo/CPU, fp32: losses and MTP losses within 1e-5,
pre-clip gradient norms within 1e-4; TP2+SP and PP2 built on the meta device and initialised
shard by shard), and the TP2 and PP2 runs' checkpoints hold the one
process's weights under their global names.

One torchrun launch runs every job: this file is also the worker (`torchrun ... this_file spec.json`).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

import parallel_harness as H  # noqa: E402

from tessera.common.checkpoint import load_model_tensors  # noqa: E402
from tessera.common.errors import UserError  # noqa: E402
from tessera.common.layout import ParallelLayout, validate_layout  # noqa: E402
from tessera.common.models.causal_lm.config import ModelConfig  # noqa: E402

STEPS = 3
LOSS_RTOL, NORM_RTOL = 1e-5, 1e-4
MODEL = dict(arch="deepseek_v3", vocab_size=128, hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=4,
             ffn_hidden_size=64, max_seq_len=32,
             mla=dict(q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8),
             moe=dict(num_experts=8, top_k=2, ffn_hidden_size=16, first_k_dense=1, score="sigmoid",
                      routed_scaling_factor=2.5, num_shared_experts=1, num_groups=4, topk_groups=2,
                      bias_balancing=True, bias_update_rate=0.01),
             mtp=dict(depth=1, loss_scaling_factor=0.3))
JOBS = {
    "tp2": dict(layout=dict(tensor=2), training=dict(micro_batch_size=4), parallel=dict(sequence_parallel=False),
                save=True),
    "tp2_sp_meta": dict(layout=dict(tensor=2), training=dict(micro_batch_size=4), parallel=dict(sequence_parallel=True),
                        meta=True),
    "ep2": dict(layout=dict(expert=2), training=dict(micro_batch_size=2)),
    "pp2_meta": dict(layout=dict(pipeline=2), training=dict(micro_batch_size=2), meta=True, save=True),
    "fsdp2": dict(layout=dict(data=2, data_shard=2), training=dict(micro_batch_size=2)),
    # Context parallel (no MTP: refused with it): every latent-attention layer's heads' keys and
    # values all-gathered, MLA's softmax scale (YaRN's mscale makes it differ from 1/sqrt(D)) folded
    # into the local queries.
    "cp2": dict(layout=dict(context=2), training=dict(micro_batch_size=4), model=dict(mtp=None, rope_scaling=dict(
        rope_type="yarn", factor=4.0, original_max_position_embeddings=8, mscale=1.0, mscale_all_dim=1.0))),
}


def deepseek_config(**over) -> ModelConfig:
    return ModelConfig.model_validate({**MODEL, **over})


def reference(cfg: ModelConfig) -> tuple[list[float], list[float], list[float], torch.nn.Module]:
    """Losses, pre-clip gradient norms, MTP losses and the trained model of STEPS one-process steps
    (the harness's AdamW, clipping, balancing-bias update) on the whole global batch at once."""
    import torch.nn.functional as F

    from tessera.common.layers.moe import RouterStats
    from tessera.common.models.causal_lm.model import build_model

    torch.manual_seed(0)
    model = build_model(cfg, seed=H.MODEL_SEED)
    opt, router = H.reference_optimizer(model), RouterStats(model)
    losses, norms, mtp_losses = [], [], []
    for step in range(STEPS):
        tokens, targets = H.batch(step, cfg)
        opt.zero_grad(set_to_none=True)
        if model.mtp is not None:
            model.mtp.prepare(1)
        out = model(tokens, mtp_labels=targets if model.mtp is not None else None)
        loss = F.cross_entropy(out.reshape(-1, cfg.vocab_size), targets.reshape(-1))
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), H.OPTIM["grad_clip"]).item())
        opt.step()
        router.step()
        losses.append(loss.item())
        mtp_losses.append(model.mtp.metrics()["mtp_loss"] if model.mtp is not None else None)
    return losses, norms, mtp_losses, model


def _close(got: list[float], want: list[float], rtol: float, what: str) -> None:
    assert len(got) == len(want), what
    for i, (g, w) in enumerate(zip(got, want)):
        assert (g is None) == (w is None), f"{what}: step {i}: {g} vs one process {w}"
        assert w is None or abs(g - w) <= rtol * abs(w), f"{what}: step {i}: {g} vs one process {w}"


@pytest.mark.slow
@pytest.mark.distributed
def test_a_deepseek_model_with_mtp_trains_under_tp_sp_ep_pp_and_fsdp_and_without_it_under_cp_like_one_process(tmp_path):
    import subprocess

    torch.set_num_threads(1)
    jobs = [{**j, "name": n, "out": str(tmp_path / f"{n}.json"),
             "save": str(tmp_path / f"{n}.ckpt") if j.get("save") else None} for n, j in JOBS.items()]
    (tmp_path / "spec.json").write_text(json.dumps({"jobs": jobs}))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", __file__,
           str(tmp_path / "spec.json")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    for name, job in JOBS.items():
        out = json.loads((tmp_path / f"{name}.json").read_text())
        losses, norms, mtp_losses, model = reference(deepseek_config(**job.get("model", {})))
        _close(out["losses"], losses, LOSS_RTOL, f"{name} loss")
        _close(out["grad_norms"], norms, NORM_RTOL, f"{name} grad norm")
        _close(out["mtp_losses"], mtp_losses, LOSS_RTOL, f"{name} MTP loss")
        if job.get("save"):  # global tensors under the one-process names (each rank's heads in place)
            stored = load_model_tensors(tmp_path / f"{name}.ckpt")
            want = {n: t.detach() for n, t in model.state_dict().items()}
            assert stored.keys() == want.keys(), f"{name}: {sorted(stored.keys() ^ want.keys())[:4]}"
            diff = sum((stored[n] - w).pow(2).sum().item() for n, w in want.items()) ** 0.5
            norm = sum(w.pow(2).sum().item() for w in want.values()) ** 0.5
            assert diff / norm <= LOSS_RTOL, f"{name}: weights {diff / norm:.2e} from the one process's"


@pytest.mark.parametrize(("over", "layout", "field"), [
    (dict(num_heads=3, num_kv_heads=3), dict(tensor=2), "num_heads (3)"),
    ({}, dict(pipeline=2, virtual_stages=2), "model.mtp"),
    ({}, dict(context=2), "context parallel with multi-token prediction (model.mtp)"),
])
def test_a_layout_a_deepseek_model_cannot_split_is_refused_in_one_line_naming_the_field(over, layout, field):
    with pytest.raises(UserError) as exc:
        validate_layout(deepseek_config(**over), ParallelLayout(**layout))
    assert field in str(exc.value) and "\n" not in str(exc.value)


def test_the_planner_counts_the_mtp_depths_and_the_last_stages_embedding_copy():
    from tessera.trainer.plan.memory import rank_params
    from tessera.trainer.plan.spec import PlanSpec

    cfg = deepseek_config()

    def spec(**layout) -> PlanSpec:
        return PlanSpec(model=cfg, layout=ParallelLayout(**layout), seq_len=16, micro_batch=1, global_batch=8)
    assert rank_params(spec()).total == cfg.num_params()
    pp2 = spec(pipeline=2)
    copy = cfg.vocab_rows * cfg.hidden_size
    assert rank_params(pp2, 0).total + rank_params(pp2, 1).total == cfg.num_params() + copy


def test_routing_groups_that_do_not_divide_the_experts_are_refused_naming_the_field():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=r"num_groups \(3\) must divide num_experts \(8\)"):
        deepseek_config(moe={**MODEL["moe"], "num_groups": 3})


# ---- the worker (under torchrun) -------------------------------------------------------------------
def _train_job(job: dict) -> None:
    from tessera.common.models.causal_lm.model import build_model
    from tessera.common.parallel.state import build_groups
    from tessera.trainer.parallel.runtime import ParallelRuntime

    cfg = deepseek_config(**job.get("model", {}))
    layout = ParallelLayout(**job["layout"])
    groups = build_groups(layout)
    training, parallel, optim = H.sections(layout, {"seed": H.MODEL_SEED, **job["training"]}, job.get("parallel"))
    # meta: built on the meta device, only the rank's shards allocated and initialised (sharded_init)
    rt = ParallelRuntime.build(cfg, groups, training, parallel, optim,
                               build_model=lambda: build_model(cfg, device="meta", seed=None) if job.get("meta")
                               else build_model(cfg, seed=H.MODEL_SEED))
    rows = H.GLOBAL_BATCH // groups.dp_ep
    sl = slice(groups.dp_ep_rank * rows, (groups.dp_ep_rank + 1) * rows)
    losses, norms, mtp_losses = [], [], []
    for step in range(STEPS):
        tokens, targets = H.batch(step, cfg)
        r = rt.train_step(tokens[sl], targets[sl])
        losses.append(r.loss)
        norms.append(r.grad_norm)
        mtp_losses.append(r.router.get("mtp_loss"))
    if job.get("save"):
        rt.save(job["save"])
    if groups.rank == 0:
        Path(job["out"]).write_text(json.dumps({"losses": losses, "grad_norms": norms, "mtp_losses": mtp_losses}))
    torch.distributed.barrier()


def _main() -> None:
    from tessera.common.parallel.state import destroy_distributed, init_distributed

    torch.set_num_threads(1)
    spec = json.loads(Path(sys.argv[1]).read_text())
    init_distributed()
    for job in spec["jobs"]:
        _train_job(job)
    destroy_distributed()


if __name__ == "__main__":
    _main()
