"""A checkpoint from someone else runs no code in any reader (issue: DCP unpickles `.metadata`).

DCP writes its index as a pickle and, left to itself, reads it with plain `pickle.load`; a planted
`.metadata` ran its payload in every reader. Each reader here gets a checkpoint whose index is a
pickle that would create a marker file, with the sidecar's checksum updated to match (an attacker
controls both files): the marker must never appear, and the reader must say one line and exit 2.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tessera.common.checkpoint import SIDECAR, model_tensor_specs
from tessera.common.errors import ArtifactError
from tessera.common.fileio import file_digest
from tessera.common.safe_dcp import dcp_load, read_dcp_metadata

BIN = Path(sys.executable).parent
pytestmark = pytest.mark.slow


class _Payload:
    """Pickles to a call of exec(): what an attacker would plant."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({str(self.marker)!r}, 'w').write('code ran')",))


def _plant(checkpoint: Path, marker: Path, update_sidecar: bool = True) -> None:
    """Replace the checkpoint's DCP index with the payload; re-sign the sidecar when asked."""
    (checkpoint / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    if update_sidecar:
        sidecar = json.loads((checkpoint / SIDECAR).read_text())
        sidecar["checksums"][".metadata"] = file_digest(checkpoint / ".metadata", sidecar["checksum_algorithm"])
        (checkpoint / SIDECAR).write_text(json.dumps(sidecar))


@pytest.fixture(scope="module")
def trained(tmp_path_factory, artifacts) -> tuple[Path, Path]:
    """A 2-step one-process run (its own config file) and its run directory."""
    from conftest import train_two_steps

    _, config, run = train_two_steps(artifacts, tmp_path_factory.mktemp("untrusted"))
    return config, run


def _run(argv: list[str], cwd: Path, timeout: int = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)


def _readers(config: Path, run: Path, ckpt: Path, out: Path) -> dict[str, list]:
    prompts = out / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "def f"}) + "\n")
    return {
        "ckpt info": [BIN / "tessera-ckpt", "info", ckpt],
        "ckpt verify": [BIN / "tessera-ckpt", "verify", ckpt],
        "ckpt export": [BIN / "tessera-ckpt", "export", "--format", "hf", "--checkpoint", ckpt,
                        "--output", out / "hf", "--quiet"],
        "ckpt reshard": [BIN / "tessera-ckpt", "reshard", "--checkpoint", ckpt, "--output", out / "tp2",
                         "--tensor-parallel", "2", "--pipeline-parallel", "1", "--quiet"],
        "generate": [BIN / "tessera-generate", "--checkpoint", ckpt, "--prompts", prompts,
                     "--output", out / "out.jsonl", "--max-tokens", "2"],
        "serve": [BIN / "tessera-serve", "--checkpoint", ckpt, "--port", "0"],
        "train --resume": [BIN / "tessera-train", "--config", config, f"run_dir={run}", "--resume", "--quiet",
                           "training.steps=3"],
        "train init_from": [BIN / "tessera-train", "--config", config, f"run_dir={out / 'new'}", "--quiet",
                            f"checkpoint.init_from={ckpt}", "training.steps=1"],
    }


READERS = ["ckpt info", "ckpt verify", "ckpt export", "ckpt reshard", "generate", "serve", "train --resume",
           "train init_from"]


@pytest.mark.parametrize("reader", READERS)
def test_a_planted_checkpoint_index_runs_no_code_in_any_reader(reader, trained, tmp_path):
    config, source_run = trained
    run = tmp_path / "run"
    shutil.copytree(source_run, run)
    ckpt = run / "checkpoints" / "iter_0000002"
    marker = tmp_path / "pwned"
    _plant(ckpt, marker)
    proc = _run(_readers(config, run, ckpt, tmp_path)[reader], cwd=tmp_path)
    assert not marker.exists(), f"{reader} ran code from the checkpoint"
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert ".metadata" in lines[0] and "refused" in lines[0], lines[0]


def test_a_replaced_index_is_caught_by_the_sidecar_checksum_before_unpickling(trained, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(trained[1], run)
    ckpt = run / "checkpoints" / "iter_0000002"
    marker = tmp_path / "pwned"
    _plant(ckpt, marker, update_sidecar=False)
    with pytest.raises(ArtifactError, match="checksum mismatch with the sidecar"):
        model_tensor_specs(ckpt)  # the checkpoint's reader passes the sidecar's digest to the safe one
    assert not marker.exists()


def test_a_real_checkpoint_index_reads_as_dcp_metadata(trained):
    meta = read_dcp_metadata(trained[1] / "checkpoints" / "iter_0000002")
    assert any(key.startswith("model.") for key in meta.state_dict_metadata)
    assert any(key.startswith("optimizer.") for key in meta.state_dict_metadata)


def test_non_tensor_entries_load_only_as_plain_data(tmp_path):
    import torch.distributed.checkpoint as dcp

    marker = tmp_path / "pwned"
    good, bad = tmp_path / "good", tmp_path / "bad"
    plain = {"step": 3, "names": ["a", "b"], "pair": (1, 2.5)}
    dcp.save({"w": torch.arange(4.0), "extra": plain}, checkpoint_id=str(good), no_dist=True)
    dcp.save({"w": torch.arange(4.0), "extra": _Payload(marker)}, checkpoint_id=str(bad), no_dist=True)
    state = {"w": torch.zeros(4), "extra": dict.fromkeys(plain)}
    dcp_load(state, good, no_dist=True)
    assert state["extra"] == plain and torch.equal(state["w"], torch.arange(4.0))
    with pytest.raises(ArtifactError, match="refused to load a non-tensor entry"):
        dcp_load({"w": torch.zeros(4), "extra": None}, bad, no_dist=True)
    assert not marker.exists()


def test_the_restricted_unpickler_refuses_any_foreign_global(tmp_path):
    (tmp_path / ".metadata").write_bytes(pickle.dumps(io.BytesIO(b"x")))
    with pytest.raises(ArtifactError, match=r"refused to load: it references _io\.BytesIO"):
        read_dcp_metadata(tmp_path)
