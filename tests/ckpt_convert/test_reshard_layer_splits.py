"""`tessera-ckpt reshard` accepts every layer split the trainer runs and round-trips it exactly.

The trainer cuts pipeline stages by the one rule in tessera.common.layout (uneven automatic
splits, explicit --pipeline-layers counts, interleaved virtual stages); reshard must place each
layer's tensors on the rank that runs it under that same split, record the split in the sidecar,
and give back the identical payload when resharded to where it came from.
"""

from __future__ import annotations

import pytest
import torch
from ckpt_helpers import make_checkpoint, tiny_llama
from test_reshard_import import all_tensors, optimizer_state
from torch.distributed.checkpoint.metadata import MetadataIndex

from tessera.ckpt_convert.cli import run
from tessera.ckpt_convert.partition import pipeline_rank
from tessera.ckpt_convert.source import CheckpointSource
from tessera.common.checkpoint import read_sidecar, resolve_checkpoint
from tessera.common.layout import ParallelLayout, validate_layout


def reshard(src, out, tp=1, pp=1, *extra: str) -> None:
    assert run(["reshard", "--checkpoint", str(src), "--output", str(out), "--tensor-parallel", str(tp),
                "--pipeline-parallel", str(pp), *extra, "--quiet"]) == 0


def layer_files(ckpt, num_layers: int) -> dict[int, set[str]]:
    """Global layer -> the payload files holding its tensors (model and optimizer state)."""
    md = CheckpointSource(ckpt).metadata
    out: dict[int, set[str]] = {i: set() for i in range(num_layers)}
    for key, item in md.state_dict_metadata.items():
        for i in range(num_layers):
            if f"layers.{i}." in key and hasattr(item, "chunks"):
                out[i] |= {md.storage_data[MetadataIndex(key, c.offsets)].relative_path for c in item.chunks}
    return out


def payload(ckpt) -> dict[str, bytes]:
    directory = resolve_checkpoint(ckpt)
    return {p.name: p.read_bytes() for p in sorted(directory.glob("*.distcp"))}


def test_uneven_explicit_and_interleaved_splits_round_trip_bit_identical(tmp_path, tokenizer_dir):
    cfg = tiny_llama(num_layers=5)
    make_checkpoint(tmp_path / "c1", cfg, tokenizer_dir, extra=optimizer_state(cfg))
    before = all_tensors(tmp_path / "c1")
    # (name, flags, split recorded, pipeline rank of each layer) -- the trainer runs each of these.
    chain = [
        ("pp3", ["--pipeline-parallel", "3"], [2, 2, 1], [0, 0, 1, 1, 2]),  # 5 on 3: extra to the middle first
        ("pp2_14", ["--pipeline-parallel", "2", "--pipeline-layers", "1,4"], [1, 4], [0, 1, 1, 1, 1]),
        ("tp2pp2x2", ["--tensor-parallel", "2", "--pipeline-parallel", "2", "--virtual-stages", "2",
                      "--pipeline-layers", "2,1,1,1"], [2, 1, 1, 1], [0, 0, 1, 0, 1]),
        ("pp2x2_auto", ["--pipeline-parallel", "2", "--virtual-stages", "2", "--data-parallel", "2"],
         [1, 2, 1, 1], [0, 1, 1, 0, 1]),
        ("pp3_again", ["--pipeline-parallel", "3", "--pipeline-layers", "2,2,1"], [2, 2, 1], [0, 0, 1, 1, 2]),
        ("back", ["--pipeline-parallel", "1"], [5], [0, 0, 0, 0, 0]),
    ]
    prev = tmp_path / "c1"
    for name, flags, split, ranks in chain:
        tp = [] if "--tensor-parallel" in flags else ["--tensor-parallel", "1"]
        assert run(["reshard", "--checkpoint", str(prev), "--output", str(tmp_path / name), *tp, *flags,
                    "--quiet"]) == 0
        layout = read_sidecar(resolve_checkpoint(tmp_path / name)).layout
        assert layout.pipeline_layers == split, name
        # rank = tp + T * (dp + D * pp): a layer's tensors sit only in the files of its pipeline rank.
        per_stage = layout.tensor * layout.data
        want = {i: {f"__{pp * per_stage + r}_0.distcp" for r in range(per_stage)} for i, pp in enumerate(ranks)}
        got = layer_files(tmp_path / name, cfg.num_layers)
        for i in range(cfg.num_layers):  # optimizer moments split over dp ranks, model tensors over tp
            assert got[i] and got[i] <= want[i], (name, i, got[i], want[i])
        prev = tmp_path / name
    # The same layout reached twice (from one process, and from an interleaved tp2 layout): same bytes.
    assert payload(tmp_path / "pp3") == payload(tmp_path / "pp3_again")
    after = all_tensors(tmp_path / "back")
    assert before.keys() == after.keys()
    for k in before:
        assert before[k].dtype == after[k].dtype and torch.equal(before[k], after[k]), k


@pytest.mark.parametrize("layout", [
    ParallelLayout(pipeline=3),  # 4 layers on 3 stages: [1, 2, 1]
    ParallelLayout(pipeline=3, pipeline_layers=[2, 1, 1]),
    ParallelLayout(pipeline=2, pipeline_layers=[3, 1]),
    ParallelLayout(pipeline=2, virtual_stages=2),
    ParallelLayout(pipeline=2, virtual_stages=2, pipeline_layers=[1, 1, 1, 1]),
], ids=lambda lay: lay.short())
def test_reshard_places_each_layer_where_the_trainers_stages_hold_it(layout):
    """partition.pipeline_rank against the trainer's own stage cut (build_stages' ranges; stage s
    runs on pipeline rank s mod P)."""
    pipeline = pytest.importorskip("tessera.trainer.parallel.pipeline")
    cfg = tiny_llama(num_layers=4)
    counts = validate_layout(cfg, layout, seq_len=16, global_batch=8, micro_batch=2, world_size=layout.world_size)
    for stage, layers in enumerate(pipeline.stage_layer_ranges(counts)):
        for i in layers:
            assert pipeline_rank(f"layers.{i}.attn.q_proj.weight", cfg, layout) == stage % layout.pipeline
    assert pipeline_rank("embed_tokens.weight", cfg, layout) == 0
    assert pipeline_rank("lm_head.weight", cfg, layout) == layout.pipeline - 1


def test_trainer_layout_flags_and_reshard_record_the_same_split(tmp_path, tokenizer_dir):
    """A checkpoint resharded to the layout a run uses compares equal to that run's layout (so
    the trainer restores its per-rank RNG streams from it)."""
    launch = pytest.importorskip("tessera.trainer.parallel.launch")
    import argparse

    cfg = tiny_llama(num_layers=4)
    make_checkpoint(tmp_path / "c1", cfg, tokenizer_dir)
    reshard(tmp_path / "c1", tmp_path / "pp3", 1, 3, "--data-parallel", "2")
    parser = argparse.ArgumentParser()
    launch.add_parallel_arguments(parser)
    run_layout = launch.layout_from_args(parser.parse_args(["--pipeline-parallel", "3"]), world_size=6)
    saved = read_sidecar(resolve_checkpoint(tmp_path / "pp3")).layout
    assert saved == run_layout.resolved(cfg.num_layers) and saved.pipeline_layers == [1, 2, 1]
    assert saved.short() == "tp1-cp1-ep1-dp2-pp3[1,2,1]"
