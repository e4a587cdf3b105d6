"""Config loading with overrides, atomic writes, and the checkpoint pointer/resolution rules."""

from __future__ import annotations

import pytest
import torch

from tessera.common import checkpoint as ckpt
from tessera.common.config import StrictModel, describe_fields, load_config
from tessera.common.errors import ArtifactError, UserError
from tessera.common.fileio import atomic_directory, atomic_file
from tessera.common.models.causal_lm.config import ModelConfig, preset
from tessera.common.models.causal_lm.model import build_model


class _Inner(StrictModel):
    lr: float = 1e-3
    betas: list[float] = [0.9, 0.95]


class _Outer(StrictModel):
    name: str = "x"
    optim: _Inner = _Inner()
    model: ModelConfig | None = None


def test_yaml_plus_dotted_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("name: run\noptim:\n  lr: 0.1\nmodel:\n  preset: tiny\n")
    cfg = load_config(_Outer, path, ["optim.lr=3e-4", "optim.betas=[0.8,0.9]", "model.num_layers=3"])
    assert cfg.optim.lr == pytest.approx(3e-4)
    assert cfg.optim.betas == [0.8, 0.9]
    assert cfg.model.num_layers == 3 and cfg.model.hidden_size == 64


def test_config_errors_are_one_line_user_errors(tmp_path):
    with pytest.raises(UserError, match="optim.lr"):
        load_config(_Outer, None, ["optim.lr=abc"])
    with pytest.raises(UserError, match="not found"):
        load_config(_Outer, tmp_path / "missing.yaml")
    with pytest.raises(UserError, match="KEY=VALUE"):
        load_config(_Outer, None, ["optim.lr"])
    with pytest.raises(UserError, match="optim.nope"):
        load_config(_Outer, None, ["optim.nope=1"])
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes("name: caf\u00e9\n".encode("latin-1"))
    with pytest.raises(UserError, match="latin1.yaml: not UTF-8"):
        load_config(_Outer, latin1)


def test_describe_fields_lists_nested_fields():
    names = [row[0] for row in describe_fields(_Outer)]
    assert "optim.lr" in names and "name" in names


def test_atomic_file_leaves_nothing_on_failure(tmp_path):
    target = tmp_path / "out.bin"
    with pytest.raises(RuntimeError):
        with atomic_file(target) as f:
            f.write(b"partial")
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


def test_atomic_directory_replaces_only_when_complete(tmp_path):
    target = tmp_path / "d"
    with atomic_directory(target) as d:
        (d / "a").write_text("1")
    with pytest.raises(RuntimeError):
        with atomic_directory(target, overwrite=True) as d:
            (d / "a").write_text("2")
            raise RuntimeError
    assert (target / "a").read_text() == "1"
    assert [p.name for p in tmp_path.iterdir()] == ["d"]


def test_checkpoint_save_finalize_resolve_and_load(tmp_path):
    cfg = preset("tiny", vocab_size=64)
    model = build_model(cfg, seed=0)
    root = tmp_path / "run" / "checkpoints"
    it = root / ckpt.iter_dir_name(5)
    ckpt.save_model_tensors(it, model.state_dict())
    with pytest.raises(ArtifactError, match="incomplete"):
        ckpt.resolve_checkpoint(it)
    ckpt.finalize_checkpoint(it, ckpt.CheckpointSidecar(model=cfg, step=5))
    ckpt.write_pointer(root, 5)
    assert ckpt.resolve_checkpoint(tmp_path / "run") == it
    assert ckpt.resolve_checkpoint(root) == it
    ckpt.verify_checksums(it)
    loaded = ckpt.load_model_tensors(it)
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded[name], tensor), name
    sub = ckpt.load_model_tensors(it, ["final_norm.weight"])
    assert list(sub) == ["final_norm.weight"]
    # Corrupt a payload file: the checksum catches it.
    payload = next(p for p in it.iterdir() if p.suffix == ".distcp")
    payload.write_bytes(payload.read_bytes()[:-10])
    with pytest.raises(ArtifactError, match="checksum"):
        ckpt.verify_checksums(it)


def test_pointer_to_missing_checkpoint_is_reported(tmp_path):
    ckpt.write_pointer(tmp_path, 7)
    with pytest.raises(ArtifactError, match="iter_0000007"):
        ckpt.resolve_checkpoint(tmp_path)
    with pytest.raises(ArtifactError, match="not a Tessera checkpoint"):
        ckpt.resolve_checkpoint(tmp_path / "..")
