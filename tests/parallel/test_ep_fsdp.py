"""Expert parallel with fully sharded data parallel (EP2 x FSDP2, world 4) trains like one process
and resumes across layouts bit-exactly (gloo/CPU, fp32: losses 1e-5 relative, pre-clip gradient
norms 1e-4).

Experts are their own FSDP unit over the data shards of their expert group, dense parameters over
data x expert ranks (torchtitan's dp_shard_mod_ep / dp_shard); the balancing bias is a replicated
buffer. One 4-process launch runs, back to back: EP2 x FSDP2 built on the meta device (sharded
initialisation) for 3 steps, saved; resumed from it under EP1 x FSDP4 and under EP2 x ZeRO-1 DP2
for 3 steps; and EP2 x FSDP2 resumed from the FSDP4 checkpoint for 2 more. What each layout holds
right after loading another's checkpoint is saved again and compared bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path

import parallel_harness as H
import pytest
import torch
import torch.distributed.checkpoint as dcp
from test_fsdp import _stored
from test_moe_parity import assert_moe_weights
from test_parity import assert_close_seq, torchrun

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

NORM_RTOL = 1e-4
EP2_FSDP2 = dict(expert=2, data=2, data_shard=2)


def _chunks(ckpt: Path, name: str) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(offsets, sizes) of each stored piece of a tensor."""
    meta = dcp.FileSystemReader(str(ckpt)).read_metadata()
    return sorted((tuple(c.offsets), tuple(c.sizes)) for c in meta.state_dict_metadata[name].chunks)


def test_expert_parallel_with_fsdp_trains_like_one_process_and_resumes_across_layouts_bit_exactly(tmp_path):
    torch.set_num_threads(1)
    norms: list[float] = []
    want, model, _ = H.reference_run(H.model_config(**H.MOE), 8, grad_norms=norms)

    def job(name, layout, steps, start=0, **kw):
        return dict(name=name, layout=layout, training=dict(micro_batch_size=1), steps=steps, start=start,
                    save=str(tmp_path / name), out=str(tmp_path / f"{name}.json"), **kw)

    a = str(tmp_path / "a_ep2_fsdp2")
    jobs = [
        job("a_ep2_fsdp2", EP2_FSDP2, 3, meta=True),
        job("b_fsdp4", dict(data=4, data_shard=4), 3, start=3, load=a, save_loaded=str(tmp_path / "b_fsdp4_loaded")),
        job("b_ep2_zero1", dict(expert=2, data=2), 3, start=3, load=a, save_loaded=str(tmp_path / "b_zero1_loaded")),
        job("c_ep2_fsdp2", EP2_FSDP2, 2, start=6, load=str(tmp_path / "b_fsdp4"), meta=True,
            save_loaded=str(tmp_path / "c_loaded")),
    ]
    torchrun(4, {"model": H.MOE, "jobs": jobs}, tmp_path, timeout=400)

    def result(name):
        return json.loads((tmp_path / f"{name}.json").read_text())

    for name, first in (("a_ep2_fsdp2", 0), ("b_fsdp4", 3), ("b_ep2_zero1", 3), ("c_ep2_fsdp2", 6)):
        r = result(name)
        n = len(r["losses"])
        assert_close_seq(r["losses"], want[first:first + n], name)
        for i, (got, w) in enumerate(zip(r["grad_norms"], norms[first:first + n])):
            assert abs(got - w) <= NORM_RTOL * w, f"{name}: step {first + i}: grad norm {got} vs reference {w}"
        assert r["divergence"] == [0.0, 0.0], f"{name}: replicas diverged {r['divergence']}"
        assert r["router"]["moe_max_load"] >= 1.0 and r["router"]["moe_dropped"] == 0
    # Saved weights (the balancing bias exactly) are the one-process ones after 6 and 8 steps.
    _, ref6, _ = H.reference_run(H.model_config(**H.MOE), 6)
    for name in ("b_fsdp4", "b_ep2_zero1"):
        assert_moe_weights(tmp_path / name, ref6, name)
    assert_moe_weights(tmp_path / "c_ep2_fsdp2", model, "c_ep2_fsdp2")
    # Each (expert rank, data shard) stored its own rectangle of the global [experts, ffn, hidden]
    # tensor: experts split over expert ranks (dim 0), each expert's rows over data shards (dim 1).
    assert _chunks(Path(a), "model.layers.1.mlp.experts.gate_proj") == [
        ((0, 0, 0), (2, 16, 32)), ((0, 16, 0), (2, 16, 32)), ((2, 0, 0), (2, 16, 32)), ((2, 16, 0), (2, 16, 32))]
    # Layout changes move model and optimizer state (balancing bias included) bit for bit.
    for saved, loaded in (("a_ep2_fsdp2", "b_fsdp4_loaded"), ("a_ep2_fsdp2", "b_zero1_loaded"),
                          ("b_fsdp4", "c_loaded")):
        w, g = _stored(tmp_path / saved), _stored(tmp_path / loaded)
        assert w.keys() == g.keys() and any(k.startswith("optimizer.") for k in w)
        assert any(k.endswith("expert_bias") for k in w)
        assert all(torch.equal(w[k], g[k]) for k in w), f"{saved} -> {loaded}: state changed"
