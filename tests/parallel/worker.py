"""Runs parallel training jobs under torchrun for the parity tests (one launch, several jobs).

    torchrun --nproc-per-node N tests/parallel/worker.py spec.json

spec: {"model": {...overrides}, "jobs": [{"name", "layout": {...}, "training": {...}, "parallel": {...} (TrainConfig's
sections: harness.sections), "per_token_loss": false, "start": 0,
"steps": 10, "load": dir|null, "save": dir|null, "out": path, "count_cp_all_reduces": false}]}. Each job builds its groups,
trains, optionally saves (DCP, layout-free), and rank 0 writes {"losses": [...]} to `out`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

import torch
from torch.distributed.tensor import DTensor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import parallel_harness as harness  # noqa: E402

from tessera.common.layout import ParallelLayout  # noqa: E402
from tessera.common.models.causal_lm.model import Transformer, build_model  # noqa: E402
from tessera.common.parallel.random import TensorParallelRNG  # noqa: E402
from tessera.common.parallel.state import build_groups, destroy_distributed, init_distributed  # noqa: E402
from tessera.trainer.parallel.launch import add_parallel_arguments, layout_from_args  # noqa: E402
from tessera.trainer.parallel.runtime import ParallelRuntime  # noqa: E402


def rng_job(job: dict) -> None:
    """Dropout streams: equal across tensor ranks outside tensor-parallel regions, distinct inside."""
    groups = build_groups(ParallelLayout(**job["layout"]))
    rng = TensorParallelRNG(7, groups.tp_rank, groups.pp_rank, groups.device)
    rng.seed_default()
    before = torch.rand(8)
    with rng.fork():
        inside = torch.rand(8)
    after = torch.rand(8)
    draws = torch.stack([before, inside, after])
    gathered = [torch.empty_like(draws) for _ in range(groups.tp)]
    torch.distributed.all_gather(gathered, draws, group=groups.tp_group)
    torch.manual_seed(7)
    plain = torch.rand(16)
    if groups.rank == 0:
        with open(job["out"], "w") as f:
            json.dump({"draws": [g.tolist() for g in gathered], "plain": plain.tolist()}, f)
    torch.distributed.barrier()


@contextlib.contextmanager
def _counting_all_reduces(group):
    """Count the all-reduces issued over `group` (a list holding the count) while inside."""
    count, plain = [0], torch.distributed.all_reduce
    if group is None:  # nothing to count: all_reduce stays torch's own (as torch.compile expects it)
        yield count
        return

    def counted(tensor, *args, **kwargs):
        if kwargs.get("group", args[1] if len(args) > 1 else None) is group:
            count[0] += 1
        return plain(tensor, *args, **kwargs)

    torch.distributed.all_reduce = counted
    try:
        yield count
    finally:
        torch.distributed.all_reduce = plain


def run_job(job: dict, cfg) -> None:
    if job.get("kind") == "rng":
        return rng_job(job)
    if job.get("model"):
        cfg = harness.model_config(**job["model"])
    if "argv" in job:
        # As the trainer CLI would: flags -> layout (data parallel implied by the world size).
        parser = argparse.ArgumentParser()
        add_parallel_arguments(parser)
        args = parser.parse_args(job["argv"])
        layout = layout_from_args(args, torch.distributed.get_world_size())
        job = {**job, "parallel": {**job.get("parallel", {}), "sequence_parallel": args.sequence_parallel,
                                   "distributed_optimizer": args.distributed_optimizer}}
    else:
        layout = ParallelLayout(**job["layout"])
    groups = build_groups(layout)
    # A meta build is initialised from training.seed (as the trainer passes training.seed to both).
    seed = {"seed": harness.MODEL_SEED} if job.get("meta") else {}
    training, parallel, optim = harness.sections(layout, {**seed, **job.get("training", {})}, job.get("parallel"))
    if job.get("meta"):
        def builder():
            with torch.device("meta"):
                return Transformer(cfg)
    else:
        dtype = getattr(torch, job.get("dtype", "float32"))

        def builder():
            return build_model(cfg, seed=harness.MODEL_SEED, dtype=dtype)
    rt = ParallelRuntime.build(cfg, groups, training, parallel, optim, build_model=builder,
                               per_token_loss=job.get("per_token_loss", False))
    divergence = [rt.replica_divergence()]
    if job.get("save_init"):
        rt.save(job["save_init"])  # the initial weights (meta builds: sharded initialisation)
    if job.get("load"):
        rt.load(job["load"])
        if job.get("save_loaded"):
            rt.save(job["save_loaded"])  # what this layout holds right after loading (bit-exact transfer)
    losses, norms, router = [], [], {}
    result_extra: dict = {}
    rows = harness.GLOBAL_BATCH // groups.dp_ep  # expert ranks read their own rows, as data ranks do
    for step in range(job.get("start", 0), job.get("start", 0) + job["steps"]):
        inputs: dict = {}
        if job.get("documents"):
            tokens, targets, inputs = harness.documents_batch(step, cfg)
        else:
            tokens, targets = harness.batch(step, cfg)
        sl = slice(groups.dp_ep_rank * rows, (groups.dp_ep_rank + 1) * rows)
        counting = job.get("count_cp_all_reduces", False)
        with _counting_all_reduces(groups.cp_group if counting else None) as cp_all_reduces:
            r = rt.train_step(tokens[sl], targets[sl], model_inputs={k: v[sl] for k, v in inputs.items()})
        if counting:  # all-reduces over the context group in this step
            result_extra.setdefault("cp_all_reduces", []).append(cp_all_reduces[0])
        losses.append(r.loss)
        norms.append(r.grad_norm)
        router = r.router
    divergence.append(rt.replica_divergence())
    result = {"losses": losses, "grad_norms": norms, "divergence": divergence, "router": router,
              **result_extra}
    sharded = [p for p in rt.named_global_params().values() if isinstance(p, DTensor)]
    if sharded:  # FSDP: the mesh a parameter is sharded over (its last dimension: the shards)
        mesh = sharded[0].device_mesh
        result["fsdp_mesh"] = {"dims": list(mesh.mesh_dim_names), "shape": list(mesh.shape)}
    buckets = getattr(rt.optimizer, "buckets", None)  # absent under FSDP (data_shard > 1)
    if buckets is not None:
        result.update({"buckets": len(buckets.buckets), "deferred_buckets": sum(b.deferred for b in buckets.buckets),
                       "launched_during_backward": buckets.launched_during_backward})
    if job.get("compiled"):  # frames torch.compile turned into graphs (0 if compile did nothing)
        from torch._dynamo.utils import counters
        result["compiled_blocks"] = counters["stats"]["unique_graphs"]
    if job.get("eval"):
        tokens, targets = harness.batch(harness.EVAL_STEP, cfg)
        result["eval_loss"] = rt.eval_step(tokens[sl], targets[sl])
    if job.get("save"):
        rt.save(job["save"])
    if groups.rank == 0 and job.get("out"):
        with open(job["out"], "w") as f:
            json.dump(result, f)
    torch.distributed.barrier()


def main() -> None:
    torch.set_num_threads(1)
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    cfg = harness.model_config(**spec.get("model", {}))
    init_distributed()
    for job in spec["jobs"]:
        run_job(job, cfg)
    destroy_distributed()


if __name__ == "__main__":
    main()
