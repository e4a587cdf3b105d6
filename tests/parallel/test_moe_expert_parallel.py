"""Expert parallel in the training runtime: EP2 alone and with tensor, pipeline, data and context
parallel trains like one process (gloo/CPU, fp32: losses 1e-5 relative, pre-clip gradient norms 1e-4),
and checkpoints are layout-free across expert-parallel sizes (online on resume, offline with
`tessera-ckpt reshard --expert-parallel`), the balancing bias included.

The MoE is parallel_harness.MOE (4 experts, top-2, first layer dense, a shared expert, balancing
bias on, aux loss off: see test_moe_parity for why).
"""

from __future__ import annotations

import json
from pathlib import Path

import parallel_harness as H
import pytest
import torch
import torch.distributed.checkpoint as dcp
from test_moe_parity import assert_moe_weights
from test_parity import assert_close_seq, torchrun

from tessera.common.checkpoint import load_model_tensors

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

STEPS = 4
NORM_RTOL = 1e-4


def _reference(steps: int):
    norms: list[float] = []
    losses, model, _ = H.reference_run(H.model_config(**H.MOE), steps, grad_norms=norms)
    return losses, norms, model


def _out(tmp: Path, name: str) -> dict:
    return json.loads((tmp / f"{name}.json").read_text())


def _job(tmp: Path, name: str, **kw) -> dict:
    return {"name": name, "out": str(tmp / f"{name}.json"), **kw}


def read_all(ckpt: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP checkpoint (model and optimizer state), as stored."""
    meta = dcp.FileSystemReader(str(ckpt)).read_metadata()
    state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.state_dict_metadata.items()
             if hasattr(m, "size")}
    dcp.load(state, checkpoint_id=str(ckpt), no_dist=True)
    return state


def expert_blocks(ckpt: Path, name: str = "model.layers.1.mlp.experts.gate_proj") -> list[tuple[int, int]]:
    """(first expert, experts) of each stored chunk of an expert tensor, in expert order."""
    meta = dcp.FileSystemReader(str(ckpt)).read_metadata()
    return sorted((c.offsets[0], c.sizes[0]) for c in meta.state_dict_metadata[name].chunks)


def test_expert_parallel_alone_and_with_tensor_pipeline_and_data_parallel_trains_like_one_process(tmp_path):
    torch.set_num_threads(1)
    want, want_norms, model = _reference(STEPS)
    two = {  # global batch 8: each expert rank reads 4 rows
        "ep2": dict(layout=dict(expert=2), training=dict(micro_batch_size=2)),
        "ep2_allreduce": dict(layout=dict(expert=2), training=dict(micro_batch_size=2),
                              parallel=dict(distributed_optimizer=False)),
        # Packed documents, loss over the counted tokens of the whole batch (counted over data x expert).
        "ep2_documents": dict(layout=dict(expert=2), training=dict(micro_batch_size=2), per_token_loss=True,
                              documents=True),
    }
    four = {
        "ep2_tp2": dict(layout=dict(tensor=2, expert=2), training=dict(micro_batch_size=2),
                        parallel=dict(sequence_parallel=True)),
        "ep2_pp2": dict(layout=dict(expert=2, pipeline=2), training=dict(micro_batch_size=1), meta=True),
        "ep2_dp2": dict(layout=dict(expert=2, data=2), training=dict(micro_batch_size=1)),
        "ep2_cp2": dict(layout=dict(expert=2, context=2), training=dict(micro_batch_size=2)),
    }
    for nproc, jobs in ((2, two), (4, four)):
        spec = {"model": H.MOE, "jobs": [_job(tmp_path, n, steps=STEPS, save=str(tmp_path / n), **j)
                                         for n, j in jobs.items()]}
        torchrun(nproc, spec, tmp_path, timeout=400)
    doc_norms: list[float] = []
    doc_want, doc_model, _ = H.reference_run(H.model_config(**H.MOE), STEPS, grad_norms=doc_norms, documents=True)
    for name in (*two, *four):
        out = _out(tmp_path, name)
        ref = (doc_want, doc_norms, doc_model) if name == "ep2_documents" else (want, want_norms, model)
        assert_close_seq(out["losses"], ref[0], name)
        for i, (g, w) in enumerate(zip(out["grad_norms"], ref[1])):
            assert abs(g - w) <= NORM_RTOL * w, f"{name}: step {i}: grad norm {g} vs reference {w}"
        # Saved global expert tensors (and everything else, the balancing bias exactly) are the
        # one-process ones: each expert rank's slice in its place.
        assert_moe_weights(tmp_path / name, ref[2], name)
        assert out["divergence"] == [0.0, 0.0], f"{name}: replicas diverged {out['divergence']}"
        assert out["router"]["moe_max_load"] >= 1.0 and out["router"]["moe_dropped"] == 0
    # Each expert rank stored its own experts (Shard(0) over the expert mesh), once.
    assert expert_blocks(tmp_path / "ep2_dp2") == [(0, 2), (2, 2)]


def test_checkpoints_are_layout_free_across_expert_parallel_sizes(tmp_path):
    """EP2 for 3 steps, saved; resumed under EP2 it is bit-identical to an uninterrupted EP2 run
    (model, optimizer state and balancing bias); resumed under DP2 (EP1, online reshard) and under
    EP2 from a DP2 checkpoint it continues like one process; a load at another EP size holds
    exactly the saved tensors."""
    torch.set_num_threads(1)
    want, _, model = _reference(6)
    first, full, dp_first = tmp_path / "ep2_first", tmp_path / "ep2_full", tmp_path / "dp2_first"
    jobs = [
        _job(tmp_path, "ep2_full", layout=dict(expert=2), training=dict(micro_batch_size=2), steps=6, save=str(full)),
        _job(tmp_path, "ep2_first", layout=dict(expert=2), training=dict(micro_batch_size=2),
             steps=3, save=str(first)),
        _job(tmp_path, "ep2_resumed", layout=dict(expert=2), training=dict(micro_batch_size=2), start=3, steps=3,
             load=str(first), save=str(tmp_path / "ep2_resumed")),
        _job(tmp_path, "dp2_from_ep2", layout=dict(data=2), training=dict(micro_batch_size=2), start=3, steps=3,
             load=str(first), save_loaded=str(tmp_path / "dp2_loaded"), save=str(tmp_path / "dp2_from_ep2")),
        _job(tmp_path, "dp2_first", layout=dict(data=2), training=dict(micro_batch_size=2),
             steps=3, save=str(dp_first)),
        _job(tmp_path, "ep2_from_dp2", layout=dict(expert=2), training=dict(micro_batch_size=2), start=3, steps=3,
             load=str(dp_first), save_loaded=str(tmp_path / "ep2_loaded"), save=str(tmp_path / "ep2_from_dp2")),
    ]
    torchrun(2, {"model": H.MOE, "jobs": jobs}, tmp_path, timeout=400)
    # Resumed at the same EP size: bit-identical to never stopping, losses and every stored tensor.
    assert _out(tmp_path, "ep2_resumed")["losses"] == _out(tmp_path, "ep2_full")["losses"][3:]
    resumed, uninterrupted = read_all(tmp_path / "ep2_resumed"), read_all(full)
    assert resumed.keys() == uninterrupted.keys()
    assert any(k.endswith("expert_bias") for k in resumed) and any(k.startswith("optimizer.") for k in resumed)
    for k, t in uninterrupted.items():
        assert torch.equal(resumed[k], t), f"resumed EP2 run differs from the uninterrupted one at {k}"
    # Another EP size reads exactly what was saved (online reshard), then trains like one process.
    for saved, loaded in ((first, "dp2_loaded"), (dp_first, "ep2_loaded")):
        a, b = load_model_tensors(saved), load_model_tensors(tmp_path / loaded)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), loaded
    assert_close_seq(_out(tmp_path, "ep2_first")["losses"], want[:3], "ep2 (before save)")
    assert_close_seq(_out(tmp_path, "dp2_first")["losses"], want[:3], "dp2 (before save)")
    for name in ("dp2_from_ep2", "ep2_from_dp2"):
        assert_close_seq(_out(tmp_path, name)["losses"], want[3:], name)
        assert_moe_weights(tmp_path / name, model, name)


def test_offline_reshard_across_expert_parallel_sizes_round_trips_bit_identically(tmp_path):
    """An EP2 checkpoint resharded to EP1 x DP2 and back to EP2 by `tessera-ckpt reshard` holds
    bit-identical tensors (model, optimizer, balancing bias); EP2 resumes from the EP1 copy like one
    process."""
    from tessera.ckpt_convert.cli import run as tessera_ckpt
    from tessera.common.checkpoint import (
        CheckpointSidecar,
        finalize_checkpoint,
        iter_dir_name,
        read_sidecar,
        resolve_checkpoint,
        write_pointer,
    )
    from tessera.common.layout import ParallelLayout

    torch.set_num_threads(1)
    want, _, model = _reference(6)
    cfg = H.model_config(**H.MOE)
    src = tmp_path / "ep2"
    torchrun(2, {"model": H.MOE, "jobs": [_job(tmp_path, "ep2_first", layout=dict(expert=2),
                                               training=dict(micro_batch_size=2), steps=3,
                                               save=str(src / iter_dir_name(3)))]}, tmp_path)
    finalize_checkpoint(src / iter_dir_name(3), CheckpointSidecar(
        model=cfg, layout=ParallelLayout(expert=2).resolved(cfg.num_layers), step=3, contents=["model", "optimizer"]))
    write_pointer(src, 3)

    def reshard(source: Path, name: str, *flags: str) -> Path:
        assert tessera_ckpt(["reshard", "--checkpoint", str(source), "--output", str(tmp_path / name),
                             "--tensor-parallel", "1", "--pipeline-parallel", "1", *flags, "--quiet"]) == 0
        return resolve_checkpoint(tmp_path / name)

    ep1 = reshard(src, "ep1_dp2", "--expert-parallel", "1", "--data-parallel", "2")
    back = reshard(tmp_path / "ep1_dp2", "ep2_back", "--expert-parallel", "2")
    assert read_sidecar(ep1).layout.expert == 1 and read_sidecar(back).layout.expert == 2
    # Partitioned for the target: one block of experts per expert rank, whole for EP1.
    assert expert_blocks(ep1) == [(0, 4)] and expert_blocks(back) == [(0, 2), (2, 2)]
    original = read_all(resolve_checkpoint(src))
    for ck in (ep1, back):
        got = read_all(ck)
        assert got.keys() == original.keys()
        for k, t in original.items():
            assert torch.equal(got[k], t), f"{ck}: {k} changed in the reshard"
    torchrun(2, {"model": H.MOE, "jobs": [_job(tmp_path, "ep2_from_ep1", layout=dict(expert=2),
                                               training=dict(micro_batch_size=2), start=3, steps=3, load=str(ep1),
                                               save=str(tmp_path / "final"))]}, tmp_path)
    assert_close_seq(_out(tmp_path, "ep2_first")["losses"], want[:3], "ep2 (before save)")
    assert_close_seq(_out(tmp_path, "ep2_from_ep1")["losses"], want[3:], "ep2 resumed from an EP1 reshard")
    assert_moe_weights(tmp_path / "final", model, "ep2 resumed from an EP1 reshard")
