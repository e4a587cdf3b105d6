"""`tessera-data verify` finds each kind of damage and names the file; `inspect` reports and decodes."""

from __future__ import annotations

import shutil
import struct
from pathlib import Path

import pytest
from dp_helpers import run, user_error


@pytest.fixture()
def copy(tmp_path, base_shard) -> Path:
    for suffix in (".bin", ".idx", ".json"):
        shutil.copyfile(f"{base_shard}{suffix}", tmp_path / f"s{suffix}")
    return tmp_path / "s"


def test_good_shard_passes(copy, capsys):
    assert run(["verify", copy]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"OK {copy}:") and "manifest and checksums ok" in out


def _patch(path: Path, offset: int, data: bytes) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset:offset + len(data)] = data
    path.write_bytes(bytes(raw))


def test_corruptions_are_named(copy, capsys):
    idx, binf = Path(f"{copy}.idx"), Path(f"{copy}.bin")
    good_idx, good_bin = idx.read_bytes(), binf.read_bytes()

    _patch(binf, 10, b"\xff\x7f")  # a flipped token: only the checksum can tell
    assert "s.bin: sha256 does not match" in user_error(["verify", copy], capsys)
    # The same token is out of the vocabulary, which --no-checksums still catches.
    assert "outside the vocabulary" in user_error(["verify", copy, "--no-checksums"], capsys)
    binf.write_bytes(good_bin[:-2])
    assert "s.bin: " in (err := user_error(["verify", copy], capsys)) and "truncated" in err
    binf.write_bytes(good_bin)

    _patch(idx, 0, b"XXIDIDX")
    assert "bad magic" in user_error(["verify", copy], capsys)
    idx.write_bytes(good_idx)
    _patch(idx, 9, struct.pack("<Q", 2))
    assert "version 2" in user_error(["verify", copy], capsys)
    idx.write_bytes(good_idx)
    n = struct.unpack_from("<Q", good_idx, 18)[0]
    _patch(idx, 34 + 4 * n + 8 * 3, struct.pack("<q", 12345))  # pointer of sequence 3
    assert "pointer of sequence 3" in user_error(["verify", copy], capsys)
    idx.write_bytes(good_idx)
    _patch(idx, len(good_idx) - 8, struct.pack("<q", n - 1))  # document index must end at S
    assert "ends at" in user_error(["verify", copy], capsys)
    idx.write_bytes(good_idx[:-5])
    assert "s.idx" in (err := user_error(["verify", copy], capsys)) and "truncated" in err


def test_a_shard_of_float_tokens_without_a_manifest_is_refused(tmp_path, capsys):
    """Megatron's .idx may declare float32 (code 7): verify used to say OK on such a shard without a
    manifest (adopt refused it). Token ids are integers: one line naming the .idx."""
    import numpy as np

    from tessera.common.indexed_dataset import write_index

    prefix = tmp_path / "f"
    np.arange(12, dtype=np.float32).tofile(f"{prefix}.bin")
    write_index(Path(f"{prefix}.idx"), np.dtype(np.float32), np.array([5, 7]), np.array([0, 1, 2]))
    err = user_error(["verify", prefix], capsys)
    assert f"{prefix}.idx: token dtype float32 is not an integer type" in err, err


@pytest.mark.parametrize("vocab", [10**12, 0])
def test_a_manifest_vocabulary_no_token_id_can_reach_is_refused_by_verify_and_blend(copy, capsys, tmp_path, vocab):
    """The manifest is not covered by its checksums: vocab_size 10^12 (ids are int32 at most)
    passed verify and blend, and the trainer reading the mixture failed with a traceback."""
    import json

    manifest = Path(f"{copy}.json")
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "vocab_size": vocab}))
    for argv in (["verify", copy], ["blend", "--data", copy, "--seq-length", 16, "--train-samples", 2,
                                     "--output", tmp_path / "m", "--quiet"]):
        err = user_error(argv, capsys)
        assert f"{manifest}: invalid shard manifest (vocab_size: Input should be" in err, err
    assert not (tmp_path / "m").exists()


def test_inspect_reports_and_decodes(base_shard, corpus_texts, capsys):
    run(["inspect", base_shard, "--docs", "0,3", "--max-chars", 100000])
    out = capsys.readouterr().out
    assert f"{len(corpus_texts)} documents" in out and "p99" in out and "top 10 tokens" in out
    assert corpus_texts[3] + "<|endoftext|>" in out  # decoded with the tokenizer recorded in the manifest
    assert "out of range" in user_error(["inspect", base_shard, "--docs", "999"], capsys)
