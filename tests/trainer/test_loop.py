"""The loop's numerics: accumulation, recompute, precision modes, and learning."""

from __future__ import annotations

import json

import pytest
import torch
from trainer_fixtures import assert_weights_close

from tessera.common.config import load_config
from tessera.trainer.cli import main
from tessera.trainer.components.distributed import init_runtime
from tessera.trainer.config import TrainConfig
from tessera.trainer.inputs import check_inputs
from tessera.trainer.trainer import Trainer


def make_trainer(path, *overrides) -> Trainer:
    cfg = load_config(TrainConfig, path, list(overrides))
    return Trainer(cfg, check_inputs(cfg), init_runtime("cpu"), quiet=True)


def weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.engine.model.named_parameters()}


def run_steps(trainer: Trainer, n: int) -> list[float]:
    torch.manual_seed(0)
    return [trainer.train_step()[0] for _ in range(n)]


def test_gradient_accumulation_equals_one_big_batch(make_config):
    path = make_config()
    one = make_trainer(path, "training.micro_batch_size=4")
    four = make_trainer(path, "training.micro_batch_size=1")
    assert four.plan.num_micro_batches == 4
    loss_one, loss_four = run_steps(one, 3), run_steps(four, 3)
    assert loss_one == pytest.approx(loss_four, rel=1e-5)
    assert_weights_close(weights(four), weights(one), "4 micro-batches vs 1")


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_recompute_gives_the_same_gradients(make_config, mode):
    path = make_config()
    ref = make_trainer(path)
    rec = make_trainer(path, f"training.recompute={mode}")
    assert run_steps(ref, 2) == run_steps(rec, 2)
    for (name, a), b in zip(weights(ref).items(), weights(rec).values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def test_bf16_autocast_tracks_fp32_with_fp32_master_weights(make_config):
    path = make_config()
    ref = make_trainer(path)
    bf16 = make_trainer(path, "training.precision=bf16")
    losses_ref, losses_bf16 = run_steps(ref, 3), run_steps(bf16, 3)
    assert all(p.dtype == torch.float32 for p in bf16.engine.model.parameters())
    assert all(p.grad.dtype == torch.float32 for p in bf16.engine.model.parameters())
    assert losses_bf16 == pytest.approx(losses_ref, rel=2e-2)
    assert losses_bf16 != losses_ref  # it really computed in bf16


def test_fp16_overflow_skips_the_step_and_lowers_the_scale(make_config):
    trainer = make_trainer(make_config(), "training.precision=fp16", "training.fp16_initial_scale=1e38")
    before = weights(trainer)
    loss, _, stepped = trainer.train_step()
    assert not stepped and trainer.engine.loss_scale == pytest.approx(5e37, rel=1e-6)
    for name, p in trainer.engine.model.named_parameters():
        assert torch.equal(p, before[name]), name
    assert trainer.state.step == 1  # the step counts (its data is consumed), only the update is skipped


def test_fp16_with_a_sane_scale_trains(make_config):
    trainer = make_trainer(make_config(), "training.precision=fp16", "training.fp16_initial_scale=1024")
    results = [trainer.train_step() for _ in range(3)]
    assert all(stepped for _, _, stepped in results)
    assert all(torch.isfinite(torch.tensor(loss)) for loss, _, _ in results)


def test_cli_run_learns_and_writes_metrics(make_config, tmp_path):
    path = make_config(training={"steps": 30, "eval_interval": 15, "log_interval": 5},
                       schedule={"warmup_steps": 3}, logging={"tensorboard": True})
    assert main(["--config", str(path), "--quiet"]) == 0
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["step"] for r in train] == [5, 10, 15, 20, 25, 30]
    assert [r["step"] for r in evals] == [15, 30]
    assert train[-1]["loss"] < train[0]["loss"] - 0.5
    for key in ("grad_norm", "lr", "tokens_per_s", "tflops", "mfu", "memory_gib", "consumed_samples"):
        assert key in train[0], key
    assert train[-1]["consumed_samples"] == 30 * 4
    assert evals[-1]["valid_ppl"] == pytest.approx(2.718281828 ** evals[-1]["valid_loss"], rel=1e-6)
    event_files = list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))
    assert event_files and event_files[0].stat().st_size > 0


@pytest.mark.slow
def test_compiled_step_matches_eager(make_config):
    """training.compile (regional by default: per block, head + loss as one graph): same losses and weights as eager."""
    path = make_config()
    eager = make_trainer(path, "model.num_layers=1")
    compiled = make_trainer(path, "training.compile=true", "model.num_layers=1")
    assert run_steps(compiled, 2) == pytest.approx(run_steps(eager, 2), rel=1e-4)
    assert_weights_close(weights(compiled), weights(eager), "compiled vs eager")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bf16_training_and_resume_on_cuda(make_config, tmp_path):
    path = make_config(training={"steps": 20, "log_interval": 5, "device": "cuda", "precision": "bf16",
                                 "exit_after_steps": 10})
    assert main(["--config", str(path), "--quiet"]) == 0
    assert main(["--config", str(path), "--quiet", "--resume"]) == 0
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [5, 10, 15, 20]
    assert train[-1]["loss"] < train[0]["loss"] and train[-1]["memory_gib"] > 0


def test_chunked_cross_entropy_matches_full_logits(make_config):
    path = make_config()
    full = make_trainer(path)
    chunked = make_trainer(path, "training.loss_chunk_tokens=24")  # 64 tokens per micro-batch: 24 + 24 + 16
    assert run_steps(full, 2) == pytest.approx(run_steps(chunked, 2), rel=1e-6)
    assert_weights_close(weights(chunked), weights(full), "chunked vs full logits")


def test_params_norm_is_logged_and_is_the_weights_norm(make_config):
    """logging.params_norm: the logged value at the last step is the L2 norm of the final weights."""
    path = make_config(training={"steps": 2}, logging={"tensorboard": False, "params_norm": True})
    cfg = load_config(TrainConfig, path)
    trainer = Trainer(cfg, check_inputs(cfg), init_runtime("cpu"), quiet=True)
    trainer.train()
    want = torch.cat([p.detach().flatten() for p in trainer.engine.model.parameters()]).norm().item()
    records = [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    logged = [r["params_norm"] for r in records if r["kind"] == "train"]
    assert len(logged) == 2 and logged[0] != logged[1]
    assert logged[-1] == pytest.approx(want, rel=1e-6)


def _sdpa_kernels(trainer: Trainer, steps: int) -> tuple[list[float], set[str]]:
    """Losses of `steps` steps and one evaluation, and the SDPA kernels (ATen ops) they ran."""
    from torch.profiler import profile

    with profile() as prof:
        losses = run_steps(trainer, steps) + [trainer.evaluate()]
    names = {e.name for e in prof.events()}
    return losses, {n for n in names if "scaled_dot_product" in n}


def test_attention_backend_math_and_flash_each_run_their_own_kernel_and_train_alike(make_config):
    path = make_config(training={"eval_interval": 1, "eval_iters": 1})
    flash_losses, flash_ops = _sdpa_kernels(make_trainer(path, "training.attention_backend=flash"), 2)
    math_trainer = make_trainer(path, "training.attention_backend=math")
    math_losses, math_ops = _sdpa_kernels(math_trainer, 2)
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in flash_ops
    assert "aten::_scaled_dot_product_attention_math" not in flash_ops
    assert "aten::_scaled_dot_product_attention_math" in math_ops
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" not in math_ops
    assert math_losses == pytest.approx(flash_losses, rel=1e-5)
    # The setting is scoped to the steps: SDPA outside them is back to PyTorch's own choice.
    assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.math_sdp_enabled()


def test_a_call_the_chosen_attention_backend_cannot_take_stops_with_one_line_naming_the_setting(make_config):
    from tessera.common.errors import UserError

    # SDPA's CPU flash kernel has no attention dropout; only flash is enabled, so nothing falls back.
    trainer = make_trainer(make_config(), "training.attention_backend=flash", "model.attention_dropout=0.1")
    with pytest.raises(UserError, match=r"training.attention_backend=flash cannot run this model's attention"):
        trainer.train_step()
