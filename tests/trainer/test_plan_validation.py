"""tessera-plan's memory predictions against the measured peaks of real training steps.

Three torchrun launches (worlds 1, 2 and 4; gloo/CPU, fp32 unless said) run the parallel runtime
built as `tessera-train` builds it for 2 steps under 20 layouts, each rank counting the bytes of
every storage alive (tests/trainer/plan_worker.py). The planner's per-rank peak (worst rank) must
be within 10% of the measured one for every layout. The same runs check the FSDP memory
acceptance: the bytes of weights + grads + Adam state a rank holds under data_shard=N are within
15% of 1/N of the one-process figure (1/(N x C) under context parallel C: context ranks shard too), and no FSDP 4 rank's sharded initialisation holds as many
bytes as the whole model's fp32 weights. A fourth launch (world 8) trains a deeper model under
FSDP 8 with every rank's live bytes capped at one fp32 copy of its weights: a model whose full
copy does not fit a rank trains.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tessera.common.layout import ParallelLayout
from tessera.common.models.causal_lm.config import ModelConfig
from tessera.trainer.plan.memory import plan_memory
from tessera.trainer.plan.spec import PlanSpec

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

MODEL = dict(arch="llama", vocab_size=2048, hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
             ffn_hidden_size=352, max_seq_len=64)
MOE = dict(MODEL, arch="mixtral", moe=dict(num_experts=4, top_k=2, ffn_hidden_size=176))
BATCH = dict(seq_len=64, global_batch=8, micro_batch=2)
WORKER = Path(__file__).with_name("plan_worker.py")

JOBS = {  # world size -> (name, layout, parallel options, recompute)
    1: [("one process", {}, {}, "none"),
        ("one process, full recompute", {}, {}, "full"),
        ("one process, selective recompute", {}, {}, "selective"),
        ("one process, bf16 autocast", {}, dict(precision="bf16"), "none"),
        ("one process, mixture of experts", {}, dict(model=MOE), "none")],
    2: [("dp2 all-reduce", dict(data=2), dict(distributed_optimizer=False), "none"),
        ("dp2 ZeRO-1", dict(data=2), {}, "none"),
        ("fsdp2", dict(data=2, data_shard=2), {}, "none"),
        ("tp2", dict(tensor=2), dict(sequence_parallel=False), "none"),
        ("tp2 + sp", dict(tensor=2), {}, "none"),
        ("pp2 1F1B", dict(pipeline=2), {}, "none"),
        ("pp2 interleaved x2", dict(pipeline=2, virtual_stages=2), {}, "none"),
        ("cp2", dict(context=2), {}, "none"),
        ("cp2 packed documents", dict(context=2), dict(documents=[24, 40]), "none")],
    4: [("fsdp4", dict(data=4, data_shard=4), {}, "none"),
        ("hsdp 2x2", dict(data=4, data_shard=2), {}, "none"),
        ("fsdp2 x tp2 + sp, full recompute", dict(data=2, data_shard=2, tensor=2), {}, "full"),
        ("tp2 x pp2", dict(tensor=2, pipeline=2), {}, "none"),
        ("fsdp2 x pp2", dict(data=2, data_shard=2, pipeline=2), {}, "none"),
        ("fsdp2 x cp2", dict(data=2, data_shard=2, context=2), {}, "none")],
}


def _measure(tmp_path: Path) -> dict[str, dict]:
    results: dict[str, dict] = {}
    for world, jobs in JOBS.items():
        out = tmp_path / f"out{world}.json"
        spec = dict(model=MODEL, out=str(out), jobs=[
            dict(name=n, layout=dict(lay, data=lay.get("data", 1)), recompute=rc, steps=2,
                 parallel={**BATCH, **{k: v for k, v in opts.items() if k != "model"}},
                 **({"model": opts["model"]} if "model" in opts else {}))
            for n, lay, opts, rc in jobs])
        (tmp_path / f"spec{world}.json").write_text(json.dumps(spec))
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                               f"--nproc-per-node={world}", str(WORKER), str(tmp_path / f"spec{world}.json")],
                              env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        for (n, lay, opts, rc), res in zip(jobs, json.loads(out.read_text())):
            results[n] = dict(layout=lay, opts=opts, recompute=rc, ranks=res["ranks"])
    return results


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> dict[str, dict]:
    return _measure(tmp_path_factory.mktemp("plan"))


def _spec(r: dict) -> PlanSpec:
    opts = r["opts"]
    return PlanSpec(model=ModelConfig(**opts.get("model", MODEL)), layout=ParallelLayout(**r["layout"]), **BATCH,
                    sequence_parallel=opts.get("sequence_parallel", True),
                    distributed_optimizer=opts.get("distributed_optimizer", True),
                    precision=opts.get("precision", "fp32"), recompute=r["recompute"],
                    packed_documents="documents" in opts, device_type="cpu")


def test_predicted_peak_is_within_10_percent_of_the_measured_peak_for_20_layouts(measured):
    assert len(measured) >= 10
    errors = {}
    for name, r in measured.items():
        predicted = plan_memory(_spec(r)).peak
        actual = max(rank["peak"] for rank in r["ranks"])
        errors[name] = (predicted - actual) / actual
    report = "\n".join(f"{n}: {e:+.1%}" for n, e in errors.items())
    print("\npredicted - measured peak, relative:\n" + report)  # shown with pytest -s
    assert all(abs(e) < 0.10 for e in errors.values()), report


def test_fsdp_weights_grads_and_optimizer_per_rank_are_within_15_percent_of_one_nth(measured):
    unsharded = measured["one process"]["ranks"][0]["state"]
    for name, n in (("fsdp2", 2), ("fsdp4", 4), ("fsdp2 x cp2", 4)):
        for rank in measured[name]["ranks"]:
            assert abs(rank["state"] / (unsharded / n) - 1) < 0.15, (name, rank["state"], unsharded)


def test_the_planner_predicts_what_sharded_initialisation_holds(measured):
    """Sharded initialisation allocates this rank's FSDP shard of its tensor x pipeline share (FSDP
    is applied to the meta model first): the build's measured peak is that shard in fp32 plus the
    largest replayed global tensor."""
    for name in ("fsdp4", "fsdp2 x tp2 + sp, full recompute"):
        predicted = plan_memory(_spec(measured[name])).init
        for rank in measured[name]["ranks"]:
            assert abs(rank["build_peak"] / predicted - 1) < 0.10, (name, rank["build_peak"], predicted)


def test_no_fsdp4_rank_ever_holds_the_whole_models_fp32_weights_while_initialising(measured):
    """Sharded initialisation under FSDP 4 stays below one full fp32 copy of the weights on every
    rank (it allocates only the data shard). Training then holds weights + grads + Adam state of
    16 bytes per parameter / 4: exactly one fp32 copy, so the budget test below needs FSDP 8."""
    full_copy = ModelConfig(**MODEL).num_params() * 4
    for rank in measured["fsdp4"]["ranks"]:
        assert rank["state"] <= full_copy
        assert rank["build_peak"] < full_copy / 2, (rank, full_copy)


# 16 layers of d=128 (3.1M parameters, 12.3 MB in fp32), the embedding a small part: FSDP's
# gathered units (the root, a block and the prefetched next one) are small against a rank's share.
# Trained with full recompute, as models that do not fit are: without it the 16 layers' saved
# activations at 64 tokens (measured peak 18.3 MB per rank) exceed the weights themselves.
DEEP = dict(MODEL, vocab_size=512, num_layers=16)


def test_a_model_whose_fp32_weights_exceed_a_ranks_byte_budget_trains_under_fsdp8(tmp_path):
    """Issue 17's acceptance: every rank's live bytes are capped at one fp32 copy of the model's
    weights (PeakBytes raises MemoryError on the op that would exceed it, as an allocator with that
    limit would); one process cannot even build the model under the cap, FSDP 8 (full recompute)
    initialises and trains 2 steps under it (measured: 10.2-10.4 MB peaks against 12.3 MB)."""
    import torch

    sys.path.insert(0, str(WORKER.parent))
    from plan_worker import PeakBytes

    from tessera.common.models.causal_lm.model import build_model

    budget = ModelConfig(**DEEP).num_params() * 4
    with pytest.raises(MemoryError), PeakBytes(budget):
        build_model(ModelConfig(**DEEP), seed=0, dtype=torch.float32)
    out = tmp_path / "out8.json"
    spec = dict(model=DEEP, out=str(out), jobs=[dict(
        name="fsdp8", layout=dict(data=8, data_shard=8), recompute="full", steps=2, budget=budget,
        parallel=dict(BATCH, micro_batch=1))])
    (tmp_path / "spec8.json").write_text(json.dumps(spec))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=8",
                           str(WORKER), str(tmp_path / "spec8.json")],
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = json.loads(out.read_text())[0]["ranks"]
    print(f"\nbudget {budget} bytes; FSDP 8 peaks: {[r['peak'] for r in ranks]}")  # shown with pytest -s
    assert len(ranks) == 8 and all(r["peak"] <= budget for r in ranks)
