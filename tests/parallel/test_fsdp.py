"""Fully sharded data parallel (FSDP2 over Tessera's tensor parallel) trains like one process.

One 4-process torchrun launch (gloo/CPU, fp32) runs, back to back: FSDP over 4 data ranks, HSDP
2 shards x 2 replicas, FSDP 2 x TP 2, FSDP 2 x PP 2 and FSDP 2 x CP 2 built on the meta device
(fully_shard applied to the meta model, then only each rank's data shard allocated and
initialised: sharded_init), and three resume chains across layouts: FSDP 4 for 4 steps -> TP 2 x
ZeRO-1 DP 2 for 3 -> FSDP 4 for 3; from the same FSDP 4 checkpoint -> TP 2 x CP 2 for 3 -> FSDP 4
for 3 (issue 17's acceptance); and from it -> CP 2 x FSDP 2 for 3 -> FSDP 4 for 3. Under CP 2 x
FSDP 2 the context ranks shard the parameters too (one flattened mesh of 4 shards, torchtitan's
dp_shard_cp), so their gradients are summed in FSDP's reduce-scatter, not all-reduced over the
context group parameter by parameter: a step's only all-reduce over the context group is the
loss's (counted; the bucketed ZeRO-1 path issues one per bucket, the former FSDP path one per
parameter).
Per-step losses within 1e-5 and pre-clip gradient norms within 1e-4 of the single-process
reference, final weights (read back from each job's layout-free DCP checkpoint) as in
test_parity; the state a layout holds right after loading another layout's checkpoint is saved
again and compared bit for bit.
"""

from __future__ import annotations

import json

import parallel_harness as H
import pytest
import torch
import torch.distributed.checkpoint as dcp
from test_parity import assert_close_seq, assert_weights, torchrun

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

STEPS = 10
NORM_RTOL = 1e-4


def _stored(ckpt) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP checkpoint (model and optimizer state), loaded in this process."""
    meta = dcp.FileSystemReader(str(ckpt)).read_metadata()
    state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.state_dict_metadata.items()
             if hasattr(m, "size") and len(m.size) > 0}
    state.update({k: torch.zeros((), dtype=torch.float32) for k, m in meta.state_dict_metadata.items()
                  if hasattr(m, "size") and len(m.size) == 0})
    dcp.load(state, checkpoint_id=str(ckpt), no_dist=True)
    return state


def test_fsdp_hsdp_and_fsdp_with_tp_match_one_process_and_resume_across_layouts_bit_exactly(tmp_path):
    torch.set_num_threads(1)
    norms: list[float] = []
    ref_losses, ref_model, _ = H.reference_run(H.model_config(), STEPS, grad_norms=norms)

    def job(name, layout, steps=STEPS, start=0, **kw):
        return dict(name=name, layout=layout, training=dict(micro_batch_size=1), steps=steps, start=start,
                    save=str(tmp_path / name), out=str(tmp_path / f"{name}.json"), **kw)

    jobs = [
        job("fsdp4", dict(data=4, data_shard=4)),
        job("hsdp2x2", dict(data=4, data_shard=2), meta=True),
        job("fsdp2_tp2", dict(data=2, data_shard=2, tensor=2), meta=True),
        job("fsdp2_pp2", dict(data=2, data_shard=2, pipeline=2), meta=True),
        job("fsdp2_cp2", dict(data=2, data_shard=2, context=2), meta=True, count_cp_all_reduces=True),
        job("a_fsdp4", dict(data=4, data_shard=4), steps=4),
        job("b_tp2_dp2", dict(tensor=2, data=2), steps=3, start=4, load=str(tmp_path / "a_fsdp4"),
            save_loaded=str(tmp_path / "b_loaded")),
        job("c_fsdp4", dict(data=4, data_shard=4), steps=3, start=7, load=str(tmp_path / "b_tp2_dp2"),
            save_loaded=str(tmp_path / "c_loaded")),
        job("b_tp2_cp2", dict(tensor=2, context=2), steps=3, start=4, load=str(tmp_path / "a_fsdp4"),
            save_loaded=str(tmp_path / "b_cp_loaded")),
        job("c_cp_fsdp4", dict(data=4, data_shard=4), steps=3, start=7, load=str(tmp_path / "b_tp2_cp2"),
            save_loaded=str(tmp_path / "c_cp_loaded"), meta=True),
        job("b_cp2_fsdp2", dict(data=2, data_shard=2, context=2), steps=3, start=4, load=str(tmp_path / "a_fsdp4"),
            save_loaded=str(tmp_path / "b_cp_fsdp_loaded"), meta=True),
        job("c_fsdp4_from_cp", dict(data=4, data_shard=4), steps=3, start=7, load=str(tmp_path / "b_cp2_fsdp2"),
            save_loaded=str(tmp_path / "c_from_cp_fsdp_loaded")),
    ]
    torchrun(4, {"jobs": jobs}, tmp_path, timeout=400)

    def result(name):
        return json.loads((tmp_path / f"{name}.json").read_text())

    for name in ("fsdp4", "hsdp2x2", "fsdp2_tp2", "fsdp2_pp2", "fsdp2_cp2"):
        r = result(name)
        assert_close_seq(r["losses"], ref_losses, name)
        for i, (got, want) in enumerate(zip(r["grad_norms"], norms)):
            assert abs(got - want) <= NORM_RTOL * want, f"{name}: step {i}: grad norm {got} vs {want}"
        if name in ("hsdp2x2", "fsdp2_tp2", "fsdp2_pp2"):  # copies to compare: HSDP replicas, tensor-
            # replicated norms, a tied embedding's two stages (FSDP 4 and CP 2 x FSDP 2 have none:
            # data shards and context ranks hold different pieces, and the model has no buffers)
            assert r["divergence"] == [0.0, 0.0], f"{name}: replicas diverged {r['divergence']}"
        assert_weights(tmp_path / name, ref_model, name)

    # Context ranks are FSDP shards: each parameter is cut 4 ways over one flattened mesh
    # (data shards x context ranks), where before they all held the same 2 shards.
    assert result("fsdp2_cp2")["fsdp_mesh"] == {"dims": ["dp_shard_cp"], "shape": [4]}
    # The one all-reduce a step issues over the context group is the loss's (no gradient's).
    assert result("fsdp2_cp2")["cp_all_reduces"] == [1] * STEPS
    assert result("fsdp2_tp2")["fsdp_mesh"] == {"dims": ["dp_shard"], "shape": [2]}
    for b, c, what in (("b_tp2_dp2", "c_fsdp4", "fsdp4 -> tp2 x dp2 -> fsdp4"),
                       ("b_tp2_cp2", "c_cp_fsdp4", "fsdp4 -> tp2 x cp2 -> fsdp4"),
                       ("b_cp2_fsdp2", "c_fsdp4_from_cp", "fsdp4 -> cp2 x fsdp2 -> fsdp4")):
        chain = result("a_fsdp4")["losses"] + result(b)["losses"] + result(c)["losses"]
        assert_close_seq(chain, ref_losses, what)
        assert_weights(tmp_path / c, ref_model, what)
    # Layout changes move model and optimizer state bit for bit.
    for saved, loaded in (("a_fsdp4", "b_loaded"), ("b_tp2_dp2", "c_loaded"),
                          ("a_fsdp4", "b_cp_loaded"), ("b_tp2_cp2", "c_cp_loaded"),
                          ("a_fsdp4", "b_cp_fsdp_loaded"), ("b_cp2_fsdp2", "c_from_cp_fsdp_loaded")):
        want, got = _stored(tmp_path / saved), _stored(tmp_path / loaded)
        assert want.keys() == got.keys() and any(k.startswith("optimizer.") for k in want)
        assert all(torch.equal(want[k], got[k]) for k in want), f"{saved} -> {loaded}: state changed"
