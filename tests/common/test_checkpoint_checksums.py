"""Checkpoint sidecar checksums: XXH3-128 in format 2, SHA-256 sidecars of format 1 still read and
verified, checksums hashed while writing, and the hashing helpers against reference digests."""

from __future__ import annotations

import hashlib
import io
import json
import threading

import pytest
import torch
import xxhash

from tessera.common import checkpoint as ckpt
from tessera.common import fileio
from tessera.common.errors import ArtifactError
from tessera.common.models.causal_lm.config import preset
from tessera.common.models.causal_lm.model import build_model


def _checkpoint(tmp_path):
    cfg = preset("tiny", vocab_size=64)
    it = tmp_path / ckpt.iter_dir_name(3)
    ckpt.save_model_tensors(it, build_model(cfg, seed=0).state_dict())
    ckpt.finalize_checkpoint(it, ckpt.CheckpointSidecar(model=cfg, step=3))
    return it


def _payload(it):
    return next(p for p in it.iterdir() if p.suffix == ".distcp")


def _flip_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01  # same size: only a checksum can see it
    path.write_bytes(bytes(data))


def test_new_sidecar_names_xxh3_and_verify_catches_a_flipped_byte(tmp_path):
    it = _checkpoint(tmp_path)
    raw = json.loads((it / ckpt.SIDECAR).read_text())
    assert raw["format_version"] == 3 and raw["checksum_algorithm"] == "xxh3-128"
    assert set(raw["checksums"]) == {p.name for p in ckpt.checkpoint_files(it)}
    for name, digest in raw["checksums"].items():
        assert digest == xxhash.xxh3_128((it / name).read_bytes()).hexdigest()
    ckpt.verify_checksums(it)
    _flip_byte(_payload(it))
    with pytest.raises(ArtifactError, match="checksum mismatch"):
        ckpt.verify_checksums(it)


def _downgrade_to_v1(it):
    """Rewrite the sidecar as format 1 wrote it: SHA-256 digests, no checksum_algorithm field."""
    raw = json.loads((it / ckpt.SIDECAR).read_text())
    raw["format_version"] = 1
    del raw["checksum_algorithm"]
    raw["checksums"] = {name: hashlib.sha256((it / name).read_bytes()).hexdigest() for name in raw["checksums"]}
    (it / ckpt.SIDECAR).write_text(json.dumps(raw))


def test_format_1_sidecar_reads_as_sha256_and_verify_catches_a_flipped_byte(tmp_path):
    it = _checkpoint(tmp_path)
    _downgrade_to_v1(it)
    side = ckpt.read_sidecar(it)
    assert side.format_version == 1 and side.checksum_algorithm == "sha256"
    ckpt.verify_checksums(it)
    _flip_byte(_payload(it))
    with pytest.raises(ArtifactError, match="checksum mismatch"):
        ckpt.verify_checksums(it)


def test_refinalizing_a_format_1_sidecar_upgrades_it(tmp_path):
    it = _checkpoint(tmp_path)
    _downgrade_to_v1(it)
    side = ckpt.read_sidecar(it)
    ckpt.finalize_checkpoint(it, side)
    again = ckpt.read_sidecar(it)
    assert again.format_version == 3 and again.checksum_algorithm == "xxh3-128"
    ckpt.verify_checksums(it)


@pytest.mark.parametrize("field,value,message", [
    ("format_version", 4, "format version 4 is not supported"),
    ("checksum_algorithm", "md5", "checksum_algorithm 'md5' is not supported"),
])
def test_unknown_version_or_algorithm_is_refused(tmp_path, field, value, message):
    it = _checkpoint(tmp_path)
    raw = json.loads((it / ckpt.SIDECAR).read_text())
    raw[field] = value
    (it / ckpt.SIDECAR).write_text(json.dumps(raw))
    with pytest.raises(ArtifactError, match=message):
        ckpt.read_sidecar(it)


def test_finalize_uses_checksums_given_and_hashes_the_rest(tmp_path):
    it = _checkpoint(tmp_path)
    side = ckpt.read_sidecar(it)
    payload = _payload(it)
    given = {payload.name: "0" * 32}  # deliberately wrong: proves it is used, not recomputed
    ckpt.finalize_checkpoint(it, side, given)
    stored = ckpt.read_sidecar(it).checksums
    assert stored[payload.name] == "0" * 32
    assert stored[".metadata"] == xxhash.xxh3_128((it / ".metadata").read_bytes()).hexdigest()
    with pytest.raises(ArtifactError, match="checksum mismatch"):
        ckpt.verify_checksums(it)
    with pytest.raises(ValueError, match="not in"):
        ckpt.finalize_checkpoint(it, side, {"__9_0.distcp": "0" * 32})


@pytest.mark.parametrize("algorithm", ["sha256", "xxh3-128"])
def test_file_digest_across_windows_and_hashing_writer(tmp_path, monkeypatch, algorithm):
    monkeypatch.setattr(fileio, "_WINDOW", 1 << 16)  # several windows, and a partial last one
    data = torch.randint(0, 256, (300_001,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    blob = bytes(data.numpy())
    ref = hashlib.sha256(blob).hexdigest() if algorithm == "sha256" else xxhash.xxh3_128(blob).hexdigest()
    path = tmp_path / "blob"
    with open(path, "wb") as f:
        w = fileio.HashingWriter(f, algorithm)
        for i in range(0, len(blob), 70_000):  # several writes, memoryviews as torch.save passes them
            w.write(memoryview(blob)[i:i + 70_000])
        assert w.tell() == len(blob)
    assert w.hexdigest() == ref
    assert fileio.file_digest(path, algorithm) == ref
    (tmp_path / "empty").write_bytes(b"")
    empty = hashlib.sha256(b"").hexdigest() if algorithm == "sha256" else xxhash.xxh3_128(b"").hexdigest()
    assert fileio.file_digest(tmp_path / "empty", algorithm) == empty
    cancel = threading.Event()
    cancel.set()
    assert fileio.file_digest(path, algorithm, cancel) is None


def test_background_fsync_closes_files_and_reports_errors(tmp_path):
    files = [open(tmp_path / f"f{i}", "wb") for i in range(3)]
    with fileio.BackgroundFsync() as syncer:
        for i, f in enumerate(files):
            f.write(bytes([i]) * 10)
            syncer.submit(f)
    assert all(f.closed for f in files)
    assert [(tmp_path / f"f{i}").read_bytes() for i in range(3)] == [bytes([i]) * 10 for i in range(3)]
    with pytest.raises(io.UnsupportedOperation):
        with fileio.BackgroundFsync() as syncer:
            syncer.submit(io.BytesIO())  # no fileno: the error comes back from wait()
