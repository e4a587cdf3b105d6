"""tessera-ckpt reads a checkpoint's or an HF directory's files only from inside it: a link (or a
`..` in a name the artifact lists) that leads elsewhere is refused in one line, exit 2, and no
output is left behind; an export never copies a file from outside the checkpoint. A Hugging Face
hub cache snapshot (files linked into the repository's `blobs/`) still imports."""

from __future__ import annotations

import hashlib
import json
import pickle
import shutil
from pathlib import Path

import pytest
from ckpt_helpers import make_checkpoint, tiny_llama

from tessera.ckpt_convert.cli import main
from tessera.common.checkpoint import SIDECAR, finalize_checkpoint, read_sidecar

SECRET = "TESSERA-SECRET-5f4dcc3b5aa7"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tokenizer_dir) -> Path:
    root = make_checkpoint(tmp_path_factory.mktemp("ck") / "ck", tiny_llama(num_layers=1), tokenizer_dir)
    return root / "iter_0000010"


def _one_line_exit_2(argv: list[str], capsys) -> str:
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        main([str(a) for a in argv])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert exc.value.code == 2 and len(lines) == 1 and "Traceback" not in err, err[-2000:]
    return lines[0]


def _copy(checkpoint: Path, tmp_path: Path) -> Path:
    ckpt = tmp_path / "iter_0000010"
    shutil.copytree(checkpoint, ckpt)
    return ckpt


def _link_out(path: Path, outside: Path) -> None:
    """Move `path` out of its folder and leave a link to it: the content is the same, only its place
    is not."""
    outside.parent.mkdir(parents=True, exist_ok=True)
    path.rename(outside)
    path.symlink_to(outside)


@pytest.mark.parametrize("command", ["export", "reshard"])
def test_a_tokenizer_file_linked_outside_the_checkpoint_is_never_copied_into_an_output(
        checkpoint, tmp_path, capsys, command):
    ckpt = _copy(checkpoint, tmp_path)
    secret = tmp_path / "secret.txt"
    secret.write_text(SECRET)
    (ckpt / "tokenizer" / "chat_template.jinja").symlink_to(secret)
    out = tmp_path / "out"
    argv = (["export", "--format", "hf", "--checkpoint", ckpt, "--output", out] if command == "export" else
            ["reshard", "--checkpoint", ckpt, "--output", out, "--tensor-parallel", "2", "--pipeline-parallel", "1"])
    line = _one_line_exit_2([*argv, "--quiet", "--no-sync"], capsys)
    assert "chat_template.jinja: leads outside" in line and SECRET not in line, line
    assert not out.exists()


@pytest.mark.parametrize("name", [SIDECAR, ".metadata", "__0_0.distcp", "tokenizer"])
def test_verify_refuses_a_checkpoint_file_that_links_outside(checkpoint, tmp_path, capsys, name):
    ckpt = _copy(checkpoint, tmp_path)
    _link_out(ckpt / name, tmp_path / "elsewhere" / name)
    line = _one_line_exit_2(["verify", ckpt, "--quiet"], capsys)
    assert f"{name}: leads outside" in line, line


def test_a_dcp_index_naming_a_payload_file_outside_the_checkpoint_is_refused(checkpoint, tmp_path, capsys):
    """The payload file names come from the index (.metadata): `../x` must not be opened."""
    ckpt = _copy(checkpoint, tmp_path)
    metadata = pickle.loads((ckpt / ".metadata").read_bytes())  # our own test file: trusted
    for info in metadata.storage_data.values():
        info.relative_path = "../stolen.distcp"
    (tmp_path / "stolen.distcp").write_bytes((ckpt / "__0_0.distcp").read_bytes())
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))
    finalize_checkpoint(ckpt, read_sidecar(ckpt))  # checksums that match, as an attacker would write them
    line = _one_line_exit_2(["export", "--format", "hf", "--checkpoint", ckpt, "--output", tmp_path / "out",
                             "--quiet", "--no-sync"], capsys)
    assert "../stolen.distcp: leads outside" in line, line
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def hf_dir(checkpoint, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hf") / "hf"
    with pytest.raises(SystemExit) as exc:
        main(["export", "--format", "hf", "--checkpoint", str(checkpoint), "--output", str(out), "--quiet",
              "--no-sync"])
    assert exc.value.code == 0
    return out


@pytest.mark.parametrize("name", ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"])
def test_import_refuses_an_hf_file_that_links_outside(hf_dir, tmp_path, capsys, name):
    hf = tmp_path / "hf"
    shutil.copytree(hf_dir, hf)
    _link_out(hf / name, tmp_path / "elsewhere" / name)
    line = _one_line_exit_2(["import", "--format", "hf", "--input", hf, "--output", tmp_path / "out", "--quiet",
                             "--no-sync"], capsys)
    assert f"{name}: leads outside" in line, line
    assert not (tmp_path / "out").exists()


def test_import_refuses_a_safetensors_index_naming_a_file_outside(hf_dir, tmp_path, capsys):
    hf = tmp_path / "hf"
    shutil.copytree(hf_dir, hf)
    header = json.loads((hf / "model.safetensors").read_bytes()[8:8 + int.from_bytes(
        (hf / "model.safetensors").read_bytes()[:8], "little")])
    (hf / "model.safetensors").rename(tmp_path / "model.safetensors")
    weight_map = {name: "../model.safetensors" for name in header if name != "__metadata__"}
    (hf / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    line = _one_line_exit_2(["import", "--format", "hf", "--input", hf, "--output", tmp_path / "out", "--quiet",
                             "--no-sync"], capsys)
    assert "../model.safetensors: leads outside" in line, line


def test_a_hugging_face_hub_cache_snapshot_imports(hf_dir, tmp_path, capsys):
    repo = tmp_path / "hub" / "models--tessera--tiny"
    snapshot = repo / "snapshots" / ("1" * 40)
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for f in sorted(hf_dir.iterdir()):
        digest = hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copyfile(f, repo / "blobs" / digest)
        (snapshot / f.name).symlink_to(Path("../../blobs") / digest)
    with pytest.raises(SystemExit) as exc:
        main(["import", "--format", "hf", "--input", str(snapshot), "--output", str(tmp_path / "c"), "--quiet",
              "--no-sync"])
    assert exc.value.code == 0, capsys.readouterr().err
    assert (tmp_path / "c" / "iter_0000000" / "tokenizer" / "tokenizer.json").read_bytes() == \
        (hf_dir / "tokenizer.json").read_bytes()
