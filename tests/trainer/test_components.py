"""Schedules, weight-decay groups, data batching and FLOP accounting against references."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from tessera.common.config import load_config
from tessera.common.mixture import MixtureSplit
from tessera.common.models.causal_lm.config import PRESETS, preset
from tessera.common.models.causal_lm.model import build_model
from tessera.trainer.components.observability.metrics import gpu_peak_tflops
from tessera.trainer.components.optimizer.optim import build_optimizer, decay_groups
from tessera.trainer.components.optimizer.schedule import LRSchedule
from tessera.trainer.config import OptimConfig, ScheduleConfig, TrainConfig
from tessera.trainer.objectives.batches import MicroBatchPlan, MixtureBatches

OPT = OptimConfig(lr=1.0, min_lr=0.1)


def test_warmup_then_cosine():
    s = LRSchedule(ScheduleConfig(kind="cosine", warmup_steps=4), OPT, total_steps=14)
    assert [s(i) for i in range(4)] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert s(4) == pytest.approx(1.0)
    assert s(9) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 0.5)))
    assert s(14) == pytest.approx(0.1) and s(100) == pytest.approx(0.1)


def test_linear_constant_and_wsd():
    lin = LRSchedule(ScheduleConfig(kind="linear", warmup_steps=0), OPT, total_steps=10)
    assert [lin(i) for i in (0, 5, 10)] == pytest.approx([1.0, 0.55, 0.1])
    const = LRSchedule(ScheduleConfig(kind="constant", warmup_steps=2), OPT, total_steps=10)
    assert [const(i) for i in (0, 1, 2, 9)] == pytest.approx([0.5, 1.0, 1.0, 1.0])
    wsd = LRSchedule(ScheduleConfig(kind="wsd", warmup_steps=2, decay_fraction=0.2), OPT, total_steps=20)
    assert [wsd(i) for i in (1, 2, 15)] == pytest.approx([1.0, 1.0, 1.0])  # stable until step 16
    assert wsd(16) == pytest.approx(1.0 - 0.9 * 0.25) and wsd(19) == pytest.approx(0.1)
    assert all(wsd(i) >= wsd(i + 1) for i in range(2, 25))


@pytest.mark.parametrize("name", ["tiny", "gpt2-124m"])
def test_no_weight_decay_on_norms_and_biases(name):
    cfg = preset(name, num_layers=1)
    with torch.device("meta"):
        from tessera.common.models.causal_lm.model import Transformer
        model = Transformer(cfg)
    groups = decay_groups(model, 0.1)
    decayed = {n for n, _ in groups[0]["params"]}
    plain = {n for n, _ in groups[1]["params"]}
    assert groups[0]["weight_decay"] == 0.1 and groups[1]["weight_decay"] == 0.0
    assert decayed | plain == {n for n, _ in model.named_parameters()} and not decayed & plain
    assert all("norm" in n or n.endswith(".bias") for n in plain)
    assert all(n.endswith("weight") and "norm" not in n for n in decayed)
    assert "embed_tokens.weight" in decayed
    if cfg.bias:
        assert "layers.0.attn.q_proj.bias" in plain


def test_optimizer_is_fused_adamw_on_cpu_and_keeps_names():
    model = build_model(preset("tiny", vocab_size=64, hidden_size=32, ffn_hidden_size=64))
    opt = build_optimizer(model, OptimConfig())
    assert isinstance(opt, torch.optim.AdamW) and opt.defaults["fused"] is True
    names = [n for g in opt.param_groups for n in g["param_names"]]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())


@pytest.mark.parametrize("name", list(PRESETS))
def test_params_and_flops_per_token_match_the_real_module(name):
    """Full-size presets on the meta device (shapes only, no memory): parameters counted from the
    module, FLOPs of a real forward+backward counted by torch (math SDPA, so attention is visible).
    MoE routing is data-dependent (bincount has no meta kernel): its FLOPs are counted on a real
    CPU forward, which only the tiny MoE presets can afford; the large ones check parameters."""
    cfg = preset(name)
    model = build_model(cfg, device="meta", seed=None)
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params()
    device = "meta"
    if cfg.moe is not None:
        if cfg.num_params() > 50e6:
            return
        model, device = build_model(cfg, seed=0), "cpu"
    seq = 128
    tokens = torch.randint(0, cfg.vocab_size, (1, seq), device=device)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(tokens).float().sum().backward()
    assert counter.get_total_flops() / seq == pytest.approx(cfg.flops_per_token(seq), rel=1e-9)


def test_gpu_peak_table():
    assert gpu_peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert gpu_peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert gpu_peak_tflops("NVIDIA H200") == 989.0
    assert gpu_peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert gpu_peak_tflops("Some Future GPU") is None


def test_data_parallel_plan_partitions_the_global_batch():
    world, gbs, mbs = 4, 16, 2
    seen = []
    for rank in range(world):
        plan = MicroBatchPlan(gbs, mbs, rank, world)
        assert plan.num_micro_batches == 2
        seen.extend(np.concatenate(plan.sample_ids(consumed_samples=32)).tolist())
    assert sorted(seen) == list(range(32, 48))
    with pytest.raises(ValueError):
        MicroBatchPlan(16, 3)


def test_batches_are_mixture_samples_shifted_by_one(artifacts):
    split = MixtureSplit(artifacts["mixture"], "train")
    full = MixtureBatches(split, split.seq_length)
    inputs, labels = full.batch(np.array([0, 5]))
    assert inputs.shape == (2, split.seq_length) and inputs.dtype == torch.int64
    np.testing.assert_array_equal(inputs[1].numpy(), split[5][:-1])
    np.testing.assert_array_equal(labels[1].numpy(), split[5][1:])
    short_inputs, short_labels = MixtureBatches(split, 16).batch(np.array([5]))
    np.testing.assert_array_equal(short_inputs[0].numpy(), split[5][:16])
    np.testing.assert_array_equal(short_labels[0].numpy(), split[5][1:17])
    # Past the end of the split the order repeats (another epoch).
    wrapped, _ = full.batch(np.array([len(split) + 5]))
    assert torch.equal(wrapped[0], inputs[1])


@pytest.mark.parametrize("path", sorted(Path(__file__).resolve().parents[2].joinpath("examples", "configs").glob("*.yaml")),
                         ids=lambda p: p.name)
def test_example_configs_validate(path):
    cfg = load_config(TrainConfig, path)
    model = cfg.resolve_model(vocab_size=32000)
    assert cfg.training.seq_length <= model.max_seq_len


def test_help_lists_every_config_key(capsys):
    from tessera.trainer.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for key in ("training.exit_after_steps", "optim.weight_decay", "schedule.decay_fraction", "checkpoint.keep_last",
                "logging.tensorboard", "data.check_fingerprints", "model.num_kv_heads", "model.rope_theta",
                "training.loss_chunk_tokens", "--resume", "--peak-tflops"):
        assert key in out, key
