"""Training reads a mixture's files only from inside its folder: an index array or the manifest
linked to a file elsewhere is refused in one line, exit 2, before any step."""

from __future__ import annotations

import shutil

import pytest

from tessera.common.errors import run_cli
from tessera.trainer.cli import main


@pytest.mark.parametrize("name", ["manifest.json", "train/d0_shuffle_index.npy", "valid/dataset_index.npy"])
def test_a_mixture_file_linked_outside_the_mixture_is_refused_before_training(make_config, artifacts, tmp_path,
                                                                              capsys, name):
    mixture = tmp_path / "mixture"
    shutil.copytree(artifacts["mixture"], mixture)
    shutil.copytree(artifacts["shard"].parent, tmp_path / "shard")  # the manifest names ../shard/stdlib
    (mixture / name).rename(tmp_path / "elsewhere")
    (mixture / name).symlink_to(tmp_path / "elsewhere")
    config = make_config(data={"mixture": str(mixture), "tokenizer": str(artifacts["tokenizer"])},
                         training={"eval_interval": 1, "eval_iters": 1, "steps": 1})
    with pytest.raises(SystemExit) as exc:
        run_cli(main, ["--config", str(config), "--quiet"])
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err[-2000:]
    assert f"{name}: leads outside" in err, err
    assert not list((tmp_path / "run").glob("checkpoints/iter_*"))
