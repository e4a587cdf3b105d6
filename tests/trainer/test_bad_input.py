"""Impossible or inconsistent configs are refused before any work: one line on stderr, exit 2."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from trainer_fixtures import build_mixture

from tessera.common.errors import UserError, run_cli
from tessera.trainer.cli import main


def run_expect_usage_error(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        run_cli(main, argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "Traceback" not in err
    return err


@pytest.mark.parametrize("overrides, expected", [
    (["model.num_heads=3"], "num_heads (3) must divide hidden_size (32)"),
    (["model.num_kv_heads=3"], "num_kv_heads (3) must divide num_heads (4)"),
    (["training.seq_length=128"], "training.seq_length (128) exceeds model.max_seq_len (64)"),
    (["training.micro_batch_size=3"], "training.micro_batch_size (3) must divide training.global_batch_size (4)"),
    (["model.preset=nope"], "unknown preset 'nope'"),
    (["model.moe.num_experts=4", "model.moe.top_k=5", "model.moe.ffn_hidden_size=32"],
     "top_k (5) must not exceed num_experts (4)"),
    (["model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.ffn_hidden_size=32", "--expert-parallel", "3"],
     "--expert-parallel 3 must divide model.moe.num_experts (4)"),
    (["parallel.expert=2"], "--expert-parallel 2: the model has no mixture-of-experts layers (model.moe)"),
    (["training.precision=fp8"], "training.precision"),
    (["optim.lr=-1"], "optim.lr"),
    (["training.bogus=1"], "training.bogus"),
    # 10^12 sequences per step: the first step asked numpy for 7 TiB of sample numbers (a traceback).
    (["training.global_batch_size=1000000000000", "training.micro_batch_size=1000000000000"],
     "training.global_batch_size: Input should be less than or equal to 16777216"),
] + ([] if torch.cuda.is_available() else [(["training.device=cuda"], "no usable CUDA device")]))
def test_impossible_config_is_refused(make_config, capsys, tmp_path, overrides, expected):
    err = run_expect_usage_error(["--config", str(make_config()), *overrides], capsys)
    assert expected in err
    assert not (tmp_path / "run").exists()  # nothing was written


@pytest.mark.parametrize("overrides, override, field", [
    (["optim.lr=abc"], "override optim.lr=abc", "optim.lr"),  # a field's own type
    (["training.steps=3", "optim.lrr=1"], "override optim.lrr=1", "optim.lrr"),  # an unknown key
    (["training.micro_batch_size=3"], "override training.micro_batch_size=3", "must divide"),  # a cross-field rule
    (["model.hidden_size=abc"], "override model.hidden_size=abc", "hidden_size"),  # inside the model section
])
def test_a_bad_override_is_reported_against_the_override_not_the_yaml_file(make_config, capsys, overrides,
                                                                            override, field):
    config = make_config()
    err = run_expect_usage_error(["--config", str(config), *overrides], capsys)
    assert f"error: {override}: invalid config: " in err and field in err, err
    assert config.name not in err, err


def test_a_bad_value_in_the_yaml_file_is_still_reported_against_the_file(make_config, capsys):
    config = make_config(optim={"lr": "abc"})
    err = run_expect_usage_error(["--config", str(config), "training.steps=3"], capsys)
    assert f"{config}: invalid config: optim.lr" in err and "override" not in err, err


def test_mixture_built_for_shorter_sequence_is_refused(make_config, capsys, artifacts, tmp_path):
    # The session mixture has seq_length 32; ask for 48 (the model allows 64).
    err = run_expect_usage_error(["--config", str(make_config()), "training.seq_length=48"], capsys)
    assert "manifest.json" in err and "seq_length 32" in err and "48" in err
    assert not (tmp_path / "run").exists()


def test_mixture_of_another_tokenizer_is_refused(make_config, capsys, artifacts, tmp_path):
    other = build_mixture(tmp_path / "other", seq_length=32, vocab_size=300)
    err = run_expect_usage_error(
        ["--config", str(make_config()), f"data.tokenizer={other['tokenizer']}"], capsys)
    assert "another tokenizer" in err and "manifest.json" in err


@pytest.mark.parametrize("vocab, expected", [
    (2**25, "vocab_size 33554432 does not give a valid model (vocab_size: Input should be less than or equal to"),
    (10**12, "invalid mixture manifest (vocab_size: Input should be less than or equal to 2147483648)"),
])
def test_a_mixture_manifest_whose_vocabulary_no_model_can_have_is_refused(make_config, capsys, artifacts, tmp_path,
                                                                          vocab, expected):
    """The manifest is not covered by its own checksums: vocab_size edited to 2^25 or 10^12 made
    the trainer fail with pydantic's traceback. (check_inputs reads nothing else of the mixture
    before the model is resolved, so the manifest alone stands for it.)"""
    import json

    mixture = tmp_path / "mix"
    mixture.mkdir()
    manifest = json.loads((artifacts["mixture"] / "manifest.json").read_text())
    (mixture / "manifest.json").write_text(json.dumps({**manifest, "vocab_size": vocab}))
    err = run_expect_usage_error(["--config", str(make_config()), f"data.mixture={mixture}"], capsys)
    assert f"{mixture / 'manifest.json'}: " in err and expected in err, err
    assert not (tmp_path / "run").exists()


def test_missing_mixture_is_refused(make_config, capsys, tmp_path):
    err = run_expect_usage_error(["--config", str(make_config()), f"data.mixture={tmp_path / 'none'}"], capsys)
    assert "mixture directory not found" in err


def test_missing_config_file(capsys, tmp_path):
    err = run_expect_usage_error(["--config", str(tmp_path / "absent.yaml")], capsys)
    assert "absent.yaml" in err and "not found" in err


def test_resume_with_a_different_model_is_refused(make_config, capsys, tmp_path):
    cfg = make_config(training={"steps": 1})
    assert main(["--config", str(cfg), "--quiet"]) == 0
    err = run_expect_usage_error(["--config", str(cfg), "--resume", "model.num_layers=3"], capsys)
    assert "different model" in err


def test_cli_subprocess_exit_code_and_one_line(make_config, tmp_path):
    """The installed console script: exit 2, one line, no traceback."""
    proc = subprocess.run([sys.executable, "-m", "tessera.trainer.cli", "--config", str(make_config()),
                           "model.num_heads=5"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "num_heads (5) must divide hidden_size (32)" in lines[0], proc.stderr


@pytest.mark.parametrize("backend", ["cudnn", "efficient"])
def test_an_attention_backend_this_machine_lacks_is_refused_before_any_work(make_config, capsys, backend):
    line = run_expect_usage_error(["--config", str(make_config()), f"training.attention_backend={backend}"], capsys)
    assert f"training.attention_backend={backend} needs a CUDA device" in line


def test_the_whole_graph_compile_scope_is_refused_under_torchrun_which_compiles_per_block(make_config):
    from tessera.common.config import load_config
    from tessera.trainer.config import TrainConfig
    from tessera.trainer.inputs import check_inputs

    cfg = load_config(TrainConfig, make_config(), ["training.compile=true", "training.compile_scope=model"])
    check_inputs(cfg)  # one process: whole-graph compile is available
    with pytest.raises(UserError, match=r"training.compile_scope=model is for one process"):
        check_inputs(cfg, world_size=2)
