"""Parity of a mixture of experts under the parallel engine: tensor (with and without sequence
parallel), data and pipeline parallel train like one process (gloo/CPU, fp32), the balancing
bias included (it is updated from loads summed over the ranks that routed other tokens, and
stored in the layout-free checkpoint).

The aux loss is off here: it is computed per micro-batch on each rank (as Megatron-Core does), so
a layout that cuts the global batch into other micro-batches trains on another mean of it. Its
gradient scale is layout-consistent (coefficient / micro-batches, averaged over data ranks).
"""

from __future__ import annotations

import json
from pathlib import Path

import parallel_harness as H
import pytest
import torch
from test_parity import RTOL, assert_close_seq, torchrun

from tessera.common.checkpoint import load_model_tensors

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

STEPS = 6


def assert_moe_weights(ckpt: Path, model: torch.nn.Module, what: str) -> None:
    """Every parameter and the balancing bias, from the layout-free checkpoint, against the reference
    (normwise over the model; the bias exactly: it moves in steps of the update rate)."""
    stored = load_model_tensors(ckpt)
    ref = {n: t.detach() for n, t in model.state_dict().items()}
    assert set(stored) == set(ref), f"{what}: names differ: {set(stored) ^ set(ref)}"
    diff_sq = ref_sq = 0.0
    for name, want in ref.items():
        got = stored[name]
        assert got.shape == want.shape, f"{what}: {name}: shape {tuple(got.shape)} vs {tuple(want.shape)}"
        if name.endswith("expert_bias"):
            assert torch.equal(got, want), f"{what}: {name}: {got.tolist()} vs {want.tolist()}"
            continue
        diff_sq += (got - want).pow(2).sum().item()
        ref_sq += want.pow(2).sum().item()
    assert (diff_sq / ref_sq) ** 0.5 <= RTOL, f"{what}: model-wide relative weight error {(diff_sq / ref_sq) ** 0.5:.2e}"


def test_moe_trains_under_tensor_data_and_pipeline_parallel_like_one_process(tmp_path):
    torch.set_num_threads(1)
    cfg = H.model_config(**H.MOE)
    want, model, _ = H.reference_run(cfg, STEPS)
    biases = [b for n, b in model.state_dict().items() if n.endswith("expert_bias")]
    assert biases and all(b.abs().sum() > 0 for b in biases), "the balancing bias must move in this run"
    jobs = {
        "moe_tp2": dict(layout=dict(tensor=2), training=dict(micro_batch_size=4),
                        parallel=dict(sequence_parallel=False)),
        "moe_tp2_sp": dict(layout=dict(tensor=2), training=dict(micro_batch_size=4),
                           parallel=dict(sequence_parallel=True)),
        "moe_dp2": dict(layout=dict(data=2), training=dict(micro_batch_size=2)),
        "moe_pp2_meta": dict(layout=dict(pipeline=2), training=dict(micro_batch_size=2), meta=True),
    }
    spec = {"model": H.MOE, "jobs": [{**j, "name": n, "steps": STEPS, "save": str(tmp_path / n),
                                      "out": str(tmp_path / f"{n}.json")} for n, j in jobs.items()]}
    torchrun(2, spec, tmp_path)
    for name in jobs:
        out = json.loads((tmp_path / f"{name}.json").read_text())
        assert_close_seq(out["losses"], want, name)
        assert_moe_weights(tmp_path / name, model, name)
        assert out["divergence"] == [0.0, 0.0], f"{name}: replicas diverged {out['divergence']}"
        # Rank 0 holds MoE layers under every layout here (pp2: layers 0-1, layer 1 is MoE).
        assert out["router"]["moe_max_load"] >= 1.0 and out["router"]["moe_dropped"] == 0
