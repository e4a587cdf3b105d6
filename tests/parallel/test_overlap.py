"""Communication overlap (docs/parallelism.md, "Overlapping communication"), gloo/CPU, fp32.

One torchrun launch (2 processes, data parallel 2, ZeRO-1, two micro-batches per rank, small
buckets so there are many) runs the same 4 steps twice: with the gradient reductions launched
from the backward hooks and the parameter all-gathers left in flight into the next forward, and
with neither (everything after backward, gathers waited at once). Both must train like one
process (losses 1e-5, pre-clip gradient norms 1e-4, final weights as in test_parity) and like
each other. Then the order: the hooks' event log and the trainer's profiler trace must show the
reduce-scatters issued before backward finished, the parameter gathers waited on inside the
next forward, and, without overlap, nothing of the kind. Order, never time.

This file is also the torchrun worker (`python -m torch.distributed.run ... test_overlap.py spec`).
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import parallel_harness as H  # noqa: E402

from tessera.common.errors import UserError  # noqa: E402
from tessera.trainer.config import ParallelConfig  # noqa: E402

STEPS = 4
NORM_RTOL = 1e-4
PROFILED_STEP = 2  # 1-based, as the trainer numbers steps: the second step (its forward waits on gathers)
OVERLAP = dict(overlap_grad_reduce=True, overlap_param_gather=True)
SERIAL = dict(overlap_grad_reduce=False, overlap_param_gather=False)
JOBS = {"overlap": OVERLAP, "serial": SERIAL}


# ---- worker (runs under torchrun) -------------------------------------------------------------
def _worker(spec_path: str) -> None:
    from tessera.common.layout import ParallelLayout
    from tessera.common.models.causal_lm.model import build_model
    from tessera.common.parallel.state import build_groups, destroy_distributed, init_distributed
    from tessera.trainer.components.observability.profiling import StepProfiler
    from tessera.trainer.config import ProfilingConfig
    from tessera.trainer.parallel.runtime import ParallelRuntime

    torch.set_num_threads(1)
    spec = json.loads(Path(spec_path).read_text())
    out = Path(spec["out"])
    cfg = H.model_config()
    init_distributed()
    for name, overlap in spec["jobs"].items():
        groups = build_groups(ParallelLayout(data=2))
        sections = H.sections(groups.layout, dict(micro_batch_size=2), dict(bucket_numel=2000, **overlap))
        rt = ParallelRuntime.build(cfg, groups, *sections, build_model=lambda: build_model(cfg, seed=H.MODEL_SEED))
        profiler = StepProfiler(ProfilingConfig(start_step=PROFILED_STEP, num_steps=1, ranks=[0], record_shapes=False),
                                out / f"{name}_profile", groups.rank, groups.device, say=lambda _line: None)
        buckets = rt.optimizer.buckets
        rows = H.GLOBAL_BATCH // groups.dp
        losses, norms, events = [], [], []
        for step in range(STEPS):
            tokens, targets = H.batch(step, cfg)
            sl = slice(groups.dp_rank * rows, (groups.dp_rank + 1) * rows)
            profiler.before_step(step + 1)
            r = rt.train_step(tokens[sl], targets[sl])
            profiler.after_step(step + 1)
            losses.append(r.loss)
            norms.append(r.grad_norm)
            events.append(list(buckets.events))
        rt.save(str(out / f"{name}_ckpt"))  # with gathers in flight: the save must wait for them
        result = {"losses": losses, "grad_norms": norms, "events": events,
                  "divergence": rt.replica_divergence(),
                  "sharded": [b.index for b in buckets.buckets if b.shards > 1],
                  "deferred": [b.index for b in buckets.buckets if b.deferred]}
        if groups.rank == 0:
            (out / f"{name}.json").write_text(json.dumps(result))
        dist.barrier()
    destroy_distributed()


# ---- tests ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("overlap")
    spec = tmp / "spec.json"
    spec.write_text(json.dumps({"out": str(tmp), "jobs": JOBS}))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", __file__, str(spec)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return tmp, {name: json.loads((tmp / f"{name}.json").read_text()) for name in JOBS}


def _close(got: list[float], want: list[float], rtol: float, what: str) -> None:
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert abs(g - w) <= rtol * abs(w), f"{what}: step {i}: {g} vs {w}"


@pytest.mark.slow
@pytest.mark.distributed
def test_overlapped_reductions_and_gathers_train_like_the_serial_run_and_one_process(runs):
    from test_parity import assert_weights

    tmp, r = runs
    torch.set_num_threads(1)
    ref_norms: list[float] = []
    ref_losses, ref_model, _ = H.reference_run(H.model_config(), STEPS, grad_norms=ref_norms)
    for name in JOBS:
        _close(r[name]["losses"], ref_losses, 1e-5, f"{name} vs one process: loss")
        _close(r[name]["grad_norms"], ref_norms, NORM_RTOL, f"{name} vs one process: grad norm")
        assert r[name]["divergence"] == 0.0, f"{name}: replicas diverged"
        assert_weights(tmp / f"{name}_ckpt", ref_model, name)
    _close(r["overlap"]["losses"], r["serial"]["losses"], 1e-5, "overlap vs serial: loss")
    _close(r["overlap"]["grad_norms"], r["serial"]["grad_norms"], NORM_RTOL, "overlap vs serial: grad norm")


@pytest.mark.slow
@pytest.mark.distributed
def test_gradient_buckets_launch_in_bucket_order_before_backward_ends_only_when_overlapped(runs):
    _, r = runs
    for job in ("overlap", "serial"):
        deferred = set(r[job]["deferred"])
        assert len(r[job]["sharded"]) >= 4, "small buckets must make several"
        for step, events in enumerate(r[job]["events"]):
            kinds = [k for k, _ in events]
            launches = [i for k, i in events if k == "launch"]
            ready_at = [n for n, k in enumerate(kinds) if k == "ready"]
            first_launch, finish = kinds.index("launch"), kinds.index("finish")
            # Buckets reduced from hooks go out in bucket order (reverse layer order), the same on
            # every rank; deferred ones (tensor/pipeline pre-reduction) only after backward.
            from_hooks = [i for i in launches if i not in deferred]
            assert from_hooks == sorted(from_hooks), f"{job} step {step}: launch order {launches}"
            if job == "overlap":
                assert first_launch < ready_at[-1], f"{job} step {step}: no reduction issued during backward: {events}"
                assert len([n for n in range(finish) if kinds[n] == "launch"]) == len(from_hooks)
            else:
                assert first_launch > finish > ready_at[-1], f"{job} step {step}: launched during backward: {events}"


@pytest.mark.slow
@pytest.mark.distributed
def test_parameter_gathers_are_waited_on_by_the_next_forward_in_forward_order(runs):
    _, r = runs
    sharded = r["overlap"]["sharded"]
    for step, events in enumerate(r["overlap"]["events"]):
        waits = [i for k, i in events if k == "param_wait"]
        kinds = [k for k, _ in events]
        if step == 0:  # nothing in flight before the first step
            assert waits == []
            continue
        # Every sharded bucket's gather was still to be waited for when its first user's forward
        # began (none was waited at the end of the step), first-used bucket (the embedding's, the
        # last bucket) first, and all before backward produced a gradient.
        assert sorted(waits) == sorted(sharded), f"step {step}: waited {waits}, sharded {sharded}"
        assert waits[0] == max(sharded), f"step {step}: first wait {waits[0]}"
        assert kinds.index("ready") > max(n for n, k in enumerate(kinds) if k == "param_wait")
    for events in r["serial"]["events"]:
        assert not any(k == "param_wait" for k, _ in events)


def _trace_events(folder: Path) -> list[dict]:
    (trace,) = folder.glob(f"steps_{PROFILED_STEP:07d}-{PROFILED_STEP:07d}/rank00000.trace.json.gz")
    with gzip.open(trace, "rt") as f:
        return [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]


@pytest.mark.slow
@pytest.mark.distributed
def test_profiler_trace_shows_reduce_scatters_issued_inside_backward_only_with_overlap(runs):
    tmp, _ = runs
    for job in JOBS:
        events = _trace_events(tmp / f"{job}_profile")
        launches = [e for e in events if e["name"].startswith("tessera.dp.reduce_scatter bucket")]
        backward = [e for e in events if e["name"].startswith("autograd::engine::evaluate_function")]
        gathers = [e for e in events if e["name"].startswith("tessera.dp.all_gather bucket")]
        assert launches and backward and gathers, f"{job}: trace lacks the collectives or backward"
        # Same thread, one clock: ordering of event starts, not a duration.
        first_launch = min(e["ts"] for e in launches)
        last_backward_end = max(e["ts"] + e["dur"] for e in backward)
        last_backward_start = max(e["ts"] for e in backward)
        if job == "overlap":
            assert first_launch < last_backward_start, "overlap: first reduce-scatter after backward ended"
        else:
            assert first_launch >= last_backward_end, "serial: a reduce-scatter started inside backward"


@pytest.mark.slow
@pytest.mark.distributed
def test_interleaved_pipeline_with_both_overlaps_trains_like_one_process(tmp_path):
    """PP=2 x 2 virtual stages x DP=2 (4 processes): the gather pre-hooks sit on several chunks
    per rank, the tied head is a parameter of the last chunk itself, gradients of interleaved
    chunks complete out of bucket order, the tied embedding's buckets are deferred."""
    from test_parity import assert_close_seq, assert_weights, torchrun

    torch.set_num_threads(1)
    ref_losses, ref_model, _ = H.reference_run(H.model_config(), STEPS)
    job = dict(name="pp2x2_dp2_overlap", layout=dict(pipeline=2, virtual_stages=2, data=2), steps=STEPS,
               training=dict(micro_batch_size=1), parallel=dict(bucket_numel=3000, **OVERLAP),
               save=str(tmp_path / "ck"), out=str(tmp_path / "out.json"))
    torchrun(4, {"jobs": [job]}, tmp_path, timeout=500)
    r = json.loads((tmp_path / "out.json").read_text())
    assert_close_seq(r["losses"], ref_losses, "pp2x2 dp2 overlapped")
    assert_weights(tmp_path / "ck", ref_model, "pp2x2 dp2 overlapped")
    assert r["divergence"] == [0.0, 0.0]
    assert r["launched_during_backward"] > 0


@pytest.mark.slow
@pytest.mark.distributed
def test_tessera_train_with_both_overlaps_logs_the_one_process_run_and_traces_the_collectives(tmp_path):
    """The trainer end to end under torchrun, DP=2 with both overlaps on, profiled at step 2,
    params norm logged every step, evaluated and saved at the end (all reading the weights between
    steps, where the gathers are pending): the one-process losses (1e-5), gradient norms (1e-4),
    parameter norms and validation loss; its trace holds the bucket collectives' ranges."""
    import yaml

    sys.path.insert(0, str(Path(__file__).parent.parent / "trainer"))
    from trainer_fixtures import build_mixture

    from tessera.trainer.cli import main

    data = build_mixture(tmp_path / "data", seq_length=32, vocab_size=384)

    def config(name: str) -> Path:
        cfg = {"run_dir": str(tmp_path / name),
               "model": {"preset": "tiny", "hidden_size": 32, "ffn_hidden_size": 64, "max_seq_len": 64},
               "data": {"mixture": str(data["mixture"]), "tokenizer": str(data["tokenizer"])},
               "optim": {"lr": 3e-3, "min_lr": 3e-4, "grad_clip": 0.5},
               "training": {"global_batch_size": 8, "micro_batch_size": 2, "seq_length": 32, "steps": STEPS,
                            "log_interval": 1, "eval_interval": STEPS, "eval_iters": 1, "threads": 1},
               "logging": {"tensorboard": False, "params_norm": True}}
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(cfg))
        return tmp_path / f"{name}.yaml"

    def records(name: str, kind: str) -> list[dict]:
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        return [r for r in map(json.loads, lines) if r["kind"] == kind]

    assert main(["--config", str(config("one")), "--quiet"]) == 0
    cmd = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc-per-node=2", "-m", "tessera.trainer",
           "--config", str(config("dp2")), "--quiet", "parallel.overlap_param_gather=true",
           "parallel.overlap_grad_reduce=true", "parallel.bucket_numel=3000", f"profiling.start_step={PROFILED_STEP}",
           "profiling.num_steps=1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    got, want = records("dp2", "train"), records("one", "train")
    _close([r["loss"] for r in got], [r["loss"] for r in want], 1e-5, "trainer dp2 overlapped: loss")
    _close([r["grad_norm"] for r in got], [r["grad_norm"] for r in want], NORM_RTOL, "trainer: grad norm")
    _close([r["params_norm"] for r in got], [r["params_norm"] for r in want], 1e-6, "trainer: params norm")
    _close([records("dp2", "eval")[-1]["valid_loss"]], [records("one", "eval")[-1]["valid_loss"]], 1e-5, "eval")
    names = {e["name"].rsplit(" ", 1)[0] for e in _trace_events(tmp_path / "dp2" / "profile")}
    assert {"tessera.dp.reduce_scatter bucket", "tessera.dp.all_gather bucket"} <= names


@pytest.mark.parametrize("fields, fragment", [
    (dict(overlap_param_gather=True, distributed_optimizer=False), "needs parallel.distributed_optimizer=true"),
    (dict(overlap_param_gather=True, data_shard=2), "parallel.data_shard=1"),
    (dict(overlap_grad_reduce=False, data_shard=2), "overlap_grad_reduce=false is not supported"),
    (dict(async_tp=True), "needs parallel.tensor > 1"),
    (dict(async_tp=True, tensor=2, sequence_parallel=False), "sequence_parallel=true"),
])
def test_unsupported_overlap_settings_are_refused_in_the_config(fields, fragment):
    with pytest.raises(ValueError, match=fragment):
        ParallelConfig(**fields)


def test_async_tp_without_compile_is_refused_by_the_config_before_any_launch():
    from tessera.trainer.config import DataConfig, TrainConfig

    parallel = dict(async_tp=True, tensor=2, sequence_parallel=True)
    with pytest.raises(ValueError, match="parallel.async_tp needs training.compile=true"):
        TrainConfig(data=DataConfig(mixture="m", tokenizer="t"), training={"compile": False}, parallel=parallel)
    TrainConfig(data=DataConfig(mixture="m", tokenizer="t"), training={"compile": True}, parallel=parallel)


def test_async_tp_is_refused_with_one_line_off_cuda():
    from tessera.common.layout import ParallelLayout
    from tessera.common.parallel.state import build_groups
    from tessera.common.parallel.tensor_parallel import enable_async_tp

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        groups = build_groups(ParallelLayout(), torch.device("cpu"))
        with pytest.raises(UserError) as exc:
            enable_async_tp(groups, compiled=True, sequence_parallel=True)
        assert "needs CUDA GPUs with NCCL" in str(exc.value) and "\n" not in str(exc.value)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_compiled_sequence_parallel_layers_give_the_patterns_async_tp_fuses():
    """What async-TP needs from our layers, checked on CPU: compiled (fake two-rank group), the
    sequence all-gather feeds a column-parallel matmul as one all-gather -> split -> cat along
    the sequence, and a row-parallel matmul feeds the reduce-scatter, in forward and backward;
    inductor's micro-pipeline TP pass finds exactly these and would fuse them on CUDA. (The
    former transpose-based gathers gave neither: gather dim 0, no consumer or producer matmul.)"""
    import torch._inductor.config as inductor_config
    from torch._inductor.fx_passes import micro_pipeline_tp as mp
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from tessera.common.parallel.layers import ColumnParallelLinear, RowParallelLinear
    from tessera.common.parallel.mappings import gather_seq

    graphs: list[dict] = []

    def find(graph: torch.fx.Graph) -> None:  # after inductor's own post-grad passes
        graphs.append({"gathers": [(m.gather_dim, len(mp._find_consumer_matmuls(m.res_node)))
                                   for m in mp.find_all_gather_patterns(graph)],
                       "scatters": [(m.scatter_dim, mp._find_producer_matmul(m.input_node) is not None)
                                    for m in mp.find_reduce_scatter_patterns(graph)]})

    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        group = dist.group.WORLD
        col = ColumnParallelLinear(16, 64, False, group, sequence_parallel=True)
        row = RowParallelLinear(64, 16, False, group, sequence_parallel=True)
        torch._dynamo.reset()
        with inductor_config.patch(post_grad_custom_post_pass=find):
            block = torch.compile(lambda x: row(torch.nn.functional.silu(col(gather_seq(x, group)))))
            block(torch.randn(2, 8, 16, requires_grad=True)).sum().backward()
    finally:
        torch._dynamo.reset()
        dist.destroy_process_group()
    # Forward: gather -> q/k/v-like matmul, matmul -> reduce-scatter; backward: the adjoints.
    assert graphs == [{"gathers": [(1, 1)], "scatters": [(1, True)]}] * 2, graphs


@pytest.mark.gpu
@pytest.mark.slow
def test_async_tp_under_tp2_trains_like_one_process(tmp_path):
    """Needs 2 GPUs: TP=2 + SP, compiled blocks, async-TP on; losses as one process (GPU kernels
    against the CPU reference: test_gpu's tolerance)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("async-TP needs 2 GPUs (tensor parallel over NCCL with symmetric memory)")
    from test_parity import torchrun

    job = dict(name="async_tp", layout=dict(tensor=2), steps=3, out=str(tmp_path / "async_tp.json"),
               training=dict(micro_batch_size=2, compile=True), parallel=dict(sequence_parallel=True, async_tp=True))
    torchrun(2, {"jobs": [job]}, tmp_path, timeout=600)
    got = json.loads((tmp_path / "async_tp.json").read_text())["losses"]
    want, _, _ = H.reference_run(H.model_config(), 3)
    _close(got, want, 1e-4, "async-TP vs one process")


if __name__ == "__main__":
    _worker(sys.argv[1])
