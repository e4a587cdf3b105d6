"""checkpoint.init_from: a new run starts from another checkpoint's weights (step 0, fresh optimizer).

The round trip a user makes: train, export to Hugging Face, import back (`tessera-ckpt`), then
continue training from the import.
"""

from __future__ import annotations

import pytest
import torch
from test_bad_input import run_expect_usage_error
from test_loop import make_trainer, weights

from tessera.ckpt_convert.cli import main as ckpt_main
from tessera.trainer.cli import main
from tessera.trainer.components.checkpoint.storage import latest_checkpoint

# An lr so small that AdamW's updates vanish below fp32 resolution: the weights after training
# are exactly the weights the run started from.
FROZEN = ["optim.lr=1e-30", "optim.min_lr=0", "optim.weight_decay=0"]


@pytest.fixture
def trained(make_config, tmp_path):
    assert main(["--config", str(make_config("source")), "--quiet"]) == 0
    return tmp_path / "source"


def test_new_run_starts_from_the_checkpoints_weights_at_step_0(make_config, trained, tmp_path, capsys):
    source = make_trainer(make_config("source"))
    source.load(latest_checkpoint(trained / "checkpoints"))
    path = make_config("new")
    assert main(["--config", str(path), "--quiet", f"checkpoint.init_from={trained}", "training.steps=2",
                 *FROZEN]) == 0
    assert f"initialized the model from {trained / 'checkpoints' / 'iter_0000006'} (step 6 of that run)" in \
        capsys.readouterr().out
    new = make_trainer(path)
    new.load(latest_checkpoint(tmp_path / "new" / "checkpoints"))
    assert new.state.step == 2  # its own count, from 0
    for (name, a), b in zip(weights(source).items(), weights(new).values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def test_from_a_hugging_face_round_trip(make_config, trained, tmp_path):
    hf, imported = tmp_path / "hf", tmp_path / "imported"
    for argv in (["export", "--format", "hf", "--checkpoint", str(trained), "--output", str(hf), "--quiet"],
                 ["import", "--format", "hf", "--input", str(hf), "--output", str(imported), "--quiet"]):
        with pytest.raises(SystemExit) as exc:
            ckpt_main(argv)
        assert exc.value.code == 0
    source = make_trainer(make_config("source"))
    source.load(latest_checkpoint(trained / "checkpoints"))
    path = make_config("from_hf")
    assert main(["--config", str(path), "--quiet", f"checkpoint.init_from={imported}", "training.steps=1",
                 *FROZEN]) == 0
    new = make_trainer(path)
    new.load(latest_checkpoint(tmp_path / "from_hf" / "checkpoints"))
    for (name, a), b in zip(weights(source).items(), weights(new).values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def test_the_imported_models_generation_settings_pass_to_the_new_runs_checkpoints(make_config, trained, tmp_path):
    import json

    from tessera.common.checkpoint import read_sidecar

    hf, imported = tmp_path / "hf", tmp_path / "imported"
    with pytest.raises(SystemExit):
        ckpt_main(["export", "--format", "hf", "--checkpoint", str(trained), "--output", str(hf), "--quiet"])
    (hf / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 9], "temperature": 0.6}))
    with pytest.raises(SystemExit):
        ckpt_main(["import", "--format", "hf", "--input", str(hf), "--output", str(imported), "--quiet"])
    expected = read_sidecar(latest_checkpoint(imported)).generation
    assert expected.eos_token_ids == [1, 9] and expected.temperature == 0.6
    path = make_config("tuned")
    args = ["--config", str(path), "--quiet", f"checkpoint.init_from={imported}", *FROZEN]
    assert main([*args, "training.steps=1"]) == 0  # from the import (init_from)
    assert read_sidecar(latest_checkpoint(tmp_path / "tuned" / "checkpoints")).generation == expected
    assert main([*args, "training.steps=2", "--resume"]) == 0  # from its own checkpoint (resume)
    last = latest_checkpoint(tmp_path / "tuned" / "checkpoints")
    assert last.name == "iter_0000002" and read_sidecar(last).generation == expected


def test_dropout_and_init_scale_are_the_new_runs_choice(make_config, trained):
    path = make_config("new")
    assert main(["--config", str(path), "--quiet", f"checkpoint.init_from={trained}", "training.steps=1",
                 "model.dropout=0.1", "model.init_std=0.01"]) == 0


def test_resume_prefers_the_runs_own_checkpoint(make_config, trained, tmp_path, capsys):
    path = make_config("new")
    args = ["--config", str(path), "--quiet", f"checkpoint.init_from={trained}"]
    assert main([*args, "training.exit_after_steps=2"]) == 0
    capsys.readouterr()
    assert main([*args, "--resume"]) == 0
    out = capsys.readouterr().out
    assert "resumed from" in out and "iter_0000002" in out and "initialized the model" not in out


@pytest.mark.parametrize("overrides, expected", [
    (["model.hidden_size=64", "model.ffn_hidden_size=128"],
     "checkpoint.init_from holds another model than the config (checkpoint vs config: hidden_size 32 vs 64, "
     "ffn_hidden_size 64 vs 128, head_dim 8 vs 16)"),
    (["checkpoint.init_from=/nonexistent/ckpt"], "/nonexistent/ckpt: checkpoint not found"),
])
def test_mismatched_or_missing_source_is_one_line(make_config, trained, tmp_path, capsys, overrides, expected):
    path = make_config("new")
    err = run_expect_usage_error(["--config", str(path), f"checkpoint.init_from={trained}", *overrides], capsys)
    assert expected in err
    assert not (tmp_path / "new").exists()
