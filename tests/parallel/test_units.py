"""Single-process checks: layout validation, stage splits, flags, and the vocab-parallel loss."""

from __future__ import annotations

import argparse

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tessera.common.errors import UserError
from tessera.common.layout import ParallelLayout, split_layers, validate_layout
from tessera.common.models.causal_lm.config import ModelConfig
from tessera.common.parallel.loss import vocab_parallel_cross_entropy
from tessera.trainer.parallel.launch import add_parallel_arguments, layout_from_args, parse_pipeline_layers

CFG = ModelConfig(vocab_size=128, hidden_size=64, num_layers=8, num_heads=8, num_kv_heads=2, ffn_hidden_size=96,
                  max_seq_len=64)


def check(layout: ParallelLayout, **kw):
    args = dict(seq_len=32, global_batch=8, micro_batch=1)
    args.update(kw)
    return validate_layout(CFG, layout, **args)


@pytest.mark.parametrize("layout, kw, fragment", [
    (ParallelLayout(tensor=3), {}, "must divide num_heads"),
    (ParallelLayout(tensor=4), {}, "must divide num_kv_heads"),
    (ParallelLayout(tensor=2, pipeline=16), {}, "only 8 layers"),
    (ParallelLayout(data=3), {}, "global batch (8) must be a multiple"),
    (ParallelLayout(pipeline=4), {"global_batch": 2}, "at least as many micro-batches"),
    (ParallelLayout(pipeline=2, virtual_stages=2), {"global_batch": 3}, "multiple of --pipeline-parallel"),
    (ParallelLayout(pipeline=2, pipeline_layers=[4, 3]), {}, "sum to 7"),
    (ParallelLayout(pipeline=2, pipeline_layers=[8]), {}, "1 values given"),
    (ParallelLayout(pipeline=2, pipeline_layers=[8, 0]), {}, "at least one layer"),
    (ParallelLayout(tensor=2), {"seq_len": 31, "sequence_parallel": True}, "seq_len (31) must be divisible"),
    (ParallelLayout(tensor=2), {"seq_len": 65}, "exceeds the model's max_seq_len"),
    (ParallelLayout(virtual_stages=2), {}, "needs --pipeline-parallel above 1"),
    (ParallelLayout(expert=2), {}, "has no mixture-of-experts layers"),
    (ParallelLayout(context=2), {"seq_len": 18}, "--context-parallel 2: seq_len (18) must be divisible by 2 x 2"),
    (ParallelLayout(tensor=2), {"world_size": 4}, "processes were launched"),
    (ParallelLayout(data=4, data_shard=3), {}, "--data-shard 3 must divide the data-parallel size (4"),
    (ParallelLayout(context=2, data=2, data_shard=4), {"seq_len": 16}, "--data-shard 4 must divide the data-parallel size (2"),
    (ParallelLayout(tensor=2, data=3, data_shard=3), {}, "--data-shard 3 with --tensor-parallel 2 must divide hidden_size"),
    # Context ranks are FSDP shards too: the hidden dim splits over data shards x context ranks.
    (ParallelLayout(tensor=2, context=3, data=2, data_shard=2), {"seq_len": 36},
     "--data-shard 2 x --context-parallel 3 with --tensor-parallel 2 must divide hidden_size (64): FSDP splits each "
     "tensor-parallel weight along the hidden dim, evenly; change --data-shard 2 or --context-parallel 3, or use "
     "--tensor-parallel 1"),
])
def test_bad_layouts_refused_with_one_line(layout, kw, fragment):
    with pytest.raises(UserError) as exc:
        check(layout, **kw)
    assert fragment in str(exc.value)
    assert "\n" not in str(exc.value)


@pytest.mark.parametrize("layout", [ParallelLayout(context=3, data=2, data_shard=2), ParallelLayout(data=3, data_shard=3)])
def test_fsdp_over_one_tensor_rank_needs_no_size_to_divide_the_hidden_size(layout):
    """(Everything is then sharded along dim 0, unevenly if need be: test_fsdp_layouts builds them.)"""
    check(layout, seq_len=36, global_batch=6)


MOE_CFG = ModelConfig(**{**CFG.model_dump(), "moe": {"num_experts": 4, "top_k": 2, "ffn_hidden_size": 32}})


@pytest.mark.parametrize("cfg, layout, kw, fragment", [
    (MOE_CFG, ParallelLayout(expert=3), {}, "must divide model.moe.num_experts (4)"),
    (CFG, ParallelLayout(expert=2), {}, "no mixture-of-experts layers (model.moe)"),
    (MOE_CFG.model_copy(update={"moe": MOE_CFG.moe.model_copy(update={"ffn_hidden_size": 30})}),
     ParallelLayout(expert=2, data=4, data_shard=4), {}, "--data-shard 4 with --expert-parallel 2 must divide model.moe.ffn_hidden_size (30)"),
    (MOE_CFG, ParallelLayout(expert=2, context=3, data=2, data_shard=2), {},
     "--data-shard 2 x --context-parallel 3 with --expert-parallel 2 must divide model.moe.ffn_hidden_size (32)"),
    # Expert ranks read their own rows: the batch splits over data x expert ranks.
    (MOE_CFG, ParallelLayout(expert=2, data=2), dict(seq_len=32, global_batch=6, micro_batch=1),
     "multiple of micro batch (1) x data parallel (2) x expert parallel (2)"),
])
def test_bad_expert_parallel_layouts_are_refused_naming_the_field(cfg, layout, kw, fragment):
    with pytest.raises(UserError) as exc:
        validate_layout(cfg, layout, **kw)
    assert fragment in str(exc.value) and "\n" not in str(exc.value)


def test_expert_parallel_flag_gives_the_layout_and_splits_the_batch_with_data_ranks():
    parser = argparse.ArgumentParser()
    add_parallel_arguments(parser)
    layout = layout_from_args(parser.parse_args(["--expert-parallel", "2", "--tensor-parallel", "2"]), world_size=8)
    assert (layout.tensor, layout.expert, layout.data, layout.world_size) == (2, 2, 2, 8)
    # 8 samples over data 2 x expert 2 readers, micro-batch 1: 2 micro-batches each.
    assert validate_layout(MOE_CFG, layout, seq_len=32, global_batch=8, micro_batch=1) == [8]
    with pytest.raises(UserError, match="--expert-parallel 2 x --pipeline-parallel 1"):
        layout_from_args(parser.parse_args(["--expert-parallel", "2", "--tensor-parallel", "2"]), world_size=6)


def test_vocab_not_divisible():
    cfg = CFG.model_copy(update={"vocab_size": 127})
    with pytest.raises(UserError, match="pad the vocabulary"):
        validate_layout(cfg, ParallelLayout(tensor=2), seq_len=8, global_batch=2, micro_batch=1)


def test_layer_splits():
    assert check(ParallelLayout(pipeline=2, virtual_stages=2)) == [2, 2, 2, 2]
    assert split_layers(15, 4) == [4, 4, 4, 3]  # extra layers to the middle stages first
    assert split_layers(14, 4) == [3, 4, 4, 3]
    assert check(ParallelLayout(pipeline=2, pipeline_layers=[5, 3])) == [5, 3]


def test_flags_to_layout():
    parser = argparse.ArgumentParser()
    add_parallel_arguments(parser)
    args = parser.parse_args(["--tensor-parallel", "2", "--pipeline-parallel", "2", "--virtual-stages", "2",
                              "--pipeline-layers", "5,4,4,3"])
    layout = layout_from_args(args, world_size=8)
    assert (layout.tensor, layout.pipeline, layout.virtual_stages, layout.data) == (2, 2, 2, 2)
    assert layout.pipeline_layers == [5, 4, 4, 3]  # the split is part of the layout
    assert parse_pipeline_layers(args.pipeline_layers) == [5, 4, 4, 3]
    assert parse_pipeline_layers("auto") is None
    with pytest.raises(UserError, match="not divisible"):
        layout_from_args(args, world_size=6)
    with pytest.raises(UserError, match="comma-separated"):
        parse_pipeline_layers("5;4")
    fsdp = parser.parse_args(["--tensor-parallel", "2", "--data-shard", "2"])
    layout = layout_from_args(fsdp, world_size=8)
    assert (layout.data, layout.data_shard, layout.data_replicate) == (4, 2, 2)  # HSDP 2 x 2 under TP=2
    with pytest.raises(UserError, match="--data-shard 3 must divide the data-parallel size 4"):
        layout_from_args(parser.parse_args(["--tensor-parallel", "2", "--data-shard", "3"]), world_size=8)


@pytest.fixture
def one_process_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_vocab_parallel_cross_entropy_matches_torch(one_process_group):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 17, generator=g, dtype=torch.float64) * 4
    target = torch.randint(0, 17, (3, 5), generator=g)
    a = logits.clone().requires_grad_(True)
    b = logits.clone().requires_grad_(True)
    ours = vocab_parallel_cross_entropy(a, target, one_process_group)
    ref = F.cross_entropy(b.reshape(-1, 17), target.reshape(-1), reduction="none").reshape(3, 5)
    torch.testing.assert_close(ours, ref)
    w = torch.rand(3, 5, generator=g, dtype=torch.float64)
    (ours * w).sum().backward()
    (ref * w).sum().backward()
    torch.testing.assert_close(a.grad, b.grad)
