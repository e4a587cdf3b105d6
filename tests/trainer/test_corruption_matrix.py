"""The corruption matrix: every (corruption, command) pair is detected with one line and exit 2.

Each case copies a real prepared shard + mixture (made by the `tessera-data` CLIs, so the shard
manifest carries block checksums), damages one thing, and runs one command in process. Silent
acceptance (exit 0), a traceback, or anything but exactly one error line fails the case.
Training must refuse before any step: flipped token bytes inside the vocabulary are caught by the
block checksums on first read, index damage by the structural check at open, and a damaged
mixture index by the manifest's checksums of its arrays.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import yaml
from conftest import base_config, train_two_steps

from tessera.common.errors import run_cli
from tessera.common.indexed_dataset import HEADER_SIZE, read_index
from tessera.common.shard import shard_fingerprint
from tessera.data_prep.cli import entry as data_entry
from tessera.trainer.cli import main as train_main

pytestmark = pytest.mark.slow
SHARD = "data/stdlib_text_document"


def _idx_arrays(root: Path) -> tuple[np.memmap, int, int]:
    """The .idx bytes (writable map) with its sequence count and document-entry count."""
    path = root / f"{SHARD}.idx"
    _, lengths, _, doc_idx = read_index(path)
    return np.memmap(path, dtype=np.uint8, mode="r+"), len(lengths), len(doc_idx)


def _tokens(root: Path) -> np.memmap:
    return np.memmap(root / f"{SHARD}.bin", dtype=np.uint16, mode="r+")


def flip_token_inside_vocabulary(root: Path) -> None:
    t = _tokens(root)
    t[100] = (int(t[100]) + 1) % 512  # still a valid id: only a checksum can tell
    t.flush()


def token_outside_vocabulary(root: Path) -> None:
    t = _tokens(root)
    t[100] = 600  # vocab is 512
    t.flush()


def swapped_lengths(root: Path) -> None:
    raw, s, _ = _idx_arrays(root)
    lengths = raw[HEADER_SIZE:HEADER_SIZE + 4 * s].view("<i4")
    j = int(np.flatnonzero(lengths[1:] != lengths[0])[0]) + 1
    lengths[0], lengths[j] = int(lengths[j]), int(lengths[0])
    raw.flush()


def shifted_pointer(root: Path) -> None:
    raw, s, _ = _idx_arrays(root)
    pointers = raw[HEADER_SIZE + 4 * s:HEADER_SIZE + 12 * s].view("<i8")
    pointers[1] += 2
    raw.flush()


def decreasing_document_index(root: Path) -> None:
    raw, s, d = _idx_arrays(root)
    doc_idx = raw[HEADER_SIZE + 12 * s:HEADER_SIZE + 12 * s + 8 * d].view("<i8")
    doc_idx[2] = 0
    raw.flush()


def empty_bin(root: Path) -> None:
    (root / f"{SHARD}.bin").write_bytes(b"")


def empty_idx(root: Path) -> None:
    (root / f"{SHARD}.idx").write_bytes(b"")


def truncated_bin(root: Path) -> None:
    path = root / f"{SHARD}.bin"
    path.write_bytes(path.read_bytes()[:-2])


def idx_dtype_disagrees_with_manifest(root: Path) -> None:
    """Byte 17 of the header from 8 (uint16) to 3 (int16): same item size, so the structure still holds."""
    raw, _, _ = _idx_arrays(root)
    raw[17] = 3
    raw.flush()


def _edit_shard_manifest(root: Path, edit: Callable[[dict], None]) -> None:
    """Edit the shard's manifest and re-pin the mixture to it, as whoever rewrote one would rewrite
    both: the mixture's fingerprint check then passes, and the shard's own check must refuse."""
    path = root / f"{SHARD}.json"
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest))
    mix = root / "mix" / "manifest.json"
    mixture = json.loads(mix.read_text())
    mixture["datasets"][0]["fingerprint"] = shard_fingerprint(root / SHARD)
    mix.write_text(json.dumps(mixture))


def manifest_token_count_off_by_one(root: Path) -> None:
    _edit_shard_manifest(root, lambda m: m.update(num_tokens=m["num_tokens"] + 1))


def manifest_document_count_off_by_one(root: Path) -> None:
    _edit_shard_manifest(root, lambda m: m.update(num_documents=m["num_documents"] - 1))


def manifest_dtype_disagrees_with_header(root: Path) -> None:
    _edit_shard_manifest(root, lambda m: m.update(dtype="int16"))


def manifest_does_not_list_the_idx(root: Path) -> None:
    _edit_shard_manifest(root, lambda m: m["checksums"].pop("idx"))


def loss_mask_the_manifest_does_not_list(root: Path) -> None:
    n = json.loads((root / f"{SHARD}.json").read_text())["num_tokens"]
    (root / f"{SHARD}.mask.bin").write_bytes(b"\x01" * n)


SHARD_CORRUPTIONS: list[Callable[[Path], None]] = [
    flip_token_inside_vocabulary, token_outside_vocabulary, swapped_lengths, shifted_pointer,
    decreasing_document_index, empty_bin, empty_idx, truncated_bin,
    # the index's header and counts disagreeing with the manifest, and files the manifest does not list
    idx_dtype_disagrees_with_manifest, manifest_token_count_off_by_one, manifest_document_count_off_by_one,
    manifest_dtype_disagrees_with_header, manifest_does_not_list_the_idx, loss_mask_the_manifest_does_not_list,
]


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))


def flipped_dataset_index(root: Path) -> None:
    _flip_last_byte(root / "mix" / "train" / "dataset_sample_index.npy")


def flipped_shuffle_index(root: Path) -> None:
    _flip_last_byte(root / "mix" / "train" / "d0_shuffle_index.npy")


def missing_sample_index(root: Path) -> None:
    (root / "mix" / "train" / "d0_sample_index.npy").unlink()


def flipped_valid_split_index(root: Path) -> None:
    _flip_last_byte(root / "mix" / "valid" / "dataset_sample_index.npy")


def truncated_document_index(root: Path) -> None:
    path = root / "mix" / "train" / "d0_document_index.npy"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def manifest_not_json(root: Path) -> None:
    path = root / "mix" / "manifest.json"
    path.write_bytes(path.read_bytes()[:100])


def manifest_checksum_dropped(root: Path) -> None:
    """An array's checksum deleted from the manifest: an unchecked array must not be trusted."""
    path = root / "mix" / "manifest.json"
    manifest = json.loads(path.read_text())
    del manifest["checksums"]["train/dataset_index.npy"]
    path.write_text(json.dumps(manifest))


def manifest_shard_fingerprint_changed(root: Path) -> None:
    """The mixture was built from another shard than the one now at its path."""
    path = root / "mix" / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["datasets"][0]["fingerprint"] = "sha256:" + "0" * 64
    path.write_text(json.dumps(manifest))


def shard_deleted(root: Path) -> None:
    for suffix in (".bin", ".idx"):
        (root / f"{SHARD}{suffix}").unlink()


def _edit_mixture_manifest(root: Path, edit: Callable[[dict], None]) -> None:
    path = root / "mix" / "manifest.json"
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest))


def mixture_token_count_disagrees_with_shard(root: Path) -> None:
    _edit_mixture_manifest(root, lambda m: m["datasets"][0].update(num_tokens=m["datasets"][0]["num_tokens"] + 1))


def mixture_document_count_disagrees_with_shard(root: Path) -> None:
    _edit_mixture_manifest(root, lambda m: m["datasets"][0].update(num_documents=m["datasets"][0]["num_documents"] + 1))


def mixture_vocabulary_disagrees_with_shard(root: Path) -> None:
    _edit_mixture_manifest(root, lambda m: m.update(vocab_size=m["vocab_size"] - 12))


def mixture_sample_count_off_by_one(root: Path) -> None:
    _edit_mixture_manifest(root, lambda m: m["splits"]["train"].update(num_samples=m["splits"]["train"]["num_samples"] + 1))


def index_file_the_mixture_does_not_list(root: Path) -> None:
    shutil.copyfile(root / "mix" / "train" / "d0_shuffle_index.npy", root / "mix" / "train" / "d1_shuffle_index.npy")


# Mixture corruptions x tessera-train, the only command that reads a mixture (verify, inspect and
# merge take shards; blend writes a mixture and never reads one).
MIXTURE_CORRUPTIONS = [flipped_dataset_index, flipped_shuffle_index, missing_sample_index, flipped_valid_split_index,
                       truncated_document_index, manifest_not_json, manifest_checksum_dropped,
                       manifest_shard_fingerprint_changed, shard_deleted, mixture_token_count_disagrees_with_shard,
                       mixture_document_count_disagrees_with_shard, mixture_vocabulary_disagrees_with_shard,
                       mixture_sample_count_off_by_one, index_file_the_mixture_does_not_list]


def _train_config(root: Path, artifacts) -> Path:
    cfg = base_config(artifacts, root / "run")
    cfg["data"] = {"mixture": str(root / "mix"), "tokenizer": str(root / "tok")}
    cfg["model"]["vocab_size"] = 512
    cfg["training"]["steps"] = 1
    cfg["training"].update(eval_interval=1, eval_iters=1)  # the valid split is read too
    path = root / "train.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _commands(root: Path, artifacts) -> dict[str, Callable[[], None]]:
    shard = str(root / SHARD)
    return {
        "verify": lambda: run_cli(data_entry, ["verify", shard]),
        "inspect": lambda: run_cli(data_entry, ["inspect", shard]),
        "merge": lambda: run_cli(data_entry, ["merge", "--inputs", shard, "--output-prefix",
                                              str(root / "merged"), "--quiet"]),
        "blend": lambda: run_cli(data_entry, ["blend", "--data", "1.0", shard, "--seq-length", "32", "--split",
                                              "8,2,0", "--train-samples", "40", "--valid-samples", "4",
                                              "--output", str(root / "mix2"), "--quiet"]),
        "train": lambda: run_cli(train_main, ["--config", str(_train_config(root, artifacts)), "--quiet"]),
    }


def _expect_one_line_exit_2(command: Callable[[], None], capsys) -> str:
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        command()
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert exc.value.code == 2, f"exit {exc.value.code}; stderr:\n{err[-2000:]}"
    assert len(lines) == 1 and "Traceback" not in err, err[-2000:]
    return lines[0]


@pytest.fixture
def damaged(data_dir, tmp_path) -> Path:
    root = tmp_path / "copy"
    shutil.copytree(data_dir, root, ignore=shutil.ignore_patterns("run*", "merged*", "mix2"))
    return root


@pytest.mark.parametrize("command", ["verify", "inspect", "merge", "blend", "train"])
@pytest.mark.parametrize("corruption", SHARD_CORRUPTIONS, ids=lambda f: f.__name__)
def test_every_shard_corruption_is_refused_by_every_command(corruption, command, damaged, artifacts, capsys):
    corruption(damaged)
    line = _expect_one_line_exit_2(_commands(damaged, artifacts)[command], capsys)
    assert "stdlib_text_document" in line, line  # names the file
    assert not (damaged / "merged.bin").exists() and not (damaged / "mix2").exists()
    assert not list((damaged / "run").glob("checkpoints/iter_*"))  # refused before any step


@pytest.mark.parametrize("corruption", MIXTURE_CORRUPTIONS, ids=lambda f: f.__name__)
def test_every_mixture_corruption_is_refused_by_training(corruption, damaged, artifacts, capsys):
    corruption(damaged)
    line = _expect_one_line_exit_2(_commands(damaged, artifacts)["train"], capsys)
    assert "mix" in line or "stdlib_text_document" in line, line  # names the mixture's file, or the shard
    assert not list((damaged / "run").glob("checkpoints/iter_*"))  # refused before any step


def test_the_undamaged_copy_passes_every_command(damaged, artifacts, capsys):
    """The control: the same commands on the same copy, undamaged, succeed (so refusals above mean damage)."""
    for name, command in _commands(damaged, artifacts).items():
        with pytest.raises(SystemExit) as exc:
            command()
        assert exc.value.code == 0, (name, capsys.readouterr().err[-2000:])


@pytest.mark.parametrize("reader", ["resume", "init_from"])
def test_a_flipped_checkpoint_payload_byte_is_refused_before_training(reader, artifacts, tmp_path, capsys):
    _, config, _ = train_two_steps(artifacts, tmp_path)
    ckpt = tmp_path / "run" / "checkpoints" / "iter_0000002"
    payload = max(ckpt.glob("*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(payload.read_bytes())
    data[len(data) // 2] ^= 0x10
    payload.write_bytes(bytes(data))
    argv = (["--config", str(config), "--quiet", "--resume", "training.steps=3"] if reader == "resume" else
            ["--config", str(config), "--quiet", f"run_dir={tmp_path / 'new'}", f"checkpoint.init_from={ckpt}"])
    line = _expect_one_line_exit_2(lambda: run_cli(train_main, argv), capsys)
    assert payload.name in line and "checksum mismatch" in line, line
    assert not (tmp_path / "run" / "checkpoints" / "iter_0000003").exists()
