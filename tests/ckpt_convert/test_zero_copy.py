"""The zero-copy paths of the converters: mapped torch.save entries against torch.load, staging of
misaligned and strided tensors, aligned and hashed-as-written output, format 1 (SHA-256) inputs,
and a truncated safetensors input."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from ckpt_helpers import make_checkpoint, tiny_llama

from tessera.ckpt_convert.cli import main, run
from tessera.ckpt_convert.mapped import Staging, aligned, is_aligned, load_saved_tensor
from tessera.ckpt_convert.source import CheckpointSource
from tessera.common.checkpoint import SIDECAR, read_sidecar, resolve_checkpoint


def test_mapped_entries_equal_torch_load(tmp_path):
    """Every kind of tensor torch.save writes, at odd file offsets, loads over the file map exactly
    as torch.load reads it (strides, storage offsets, dtypes), without falling back to a copy."""
    crc32 = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)  # as our writer saves (the CRC is not what is tested)
    try:
        base = torch.randn(40, 24, generator=torch.Generator().manual_seed(0))
        cases = [base, base.t(), base[3:9, 5:], base.to(torch.bfloat16), base.to(torch.float16)[::2],
                 torch.arange(10, dtype=torch.int64), torch.tensor(3.5), torch.zeros(0, 7)]
        entries = []
        path = tmp_path / "entries"
        with open(path, "wb") as f:
            for i, t in enumerate(cases):
                f.write(b"x" * (i + 1))  # odd offsets, as DCP packs entries back to back
                start = f.tell()
                torch.save(t, f)
                entries.append((start, f.tell() - start))
    finally:
        torch.serialization.set_crc32_options(crc32)
    for t, (offset, length) in zip(cases, entries):
        got = load_saved_tensor(path, offset, length)
        assert got.dtype == t.dtype and got.shape == t.shape and got.stride() == t.stride()
        assert torch.equal(aligned(got), t)
        if t.numel():
            assert not got.untyped_storage().resizable()  # memory of the file map, not a fresh buffer


def test_staging_realigns_and_materialises():
    values = torch.arange(60, dtype=torch.float32)
    raw = bytearray(values.numel() * 4 + 1)
    memoryview(raw)[1:] = values.numpy().tobytes()
    odd = torch.frombuffer(memoryview(raw)[1:], dtype=torch.float32).view(6, 10)  # misaligned elements
    assert not is_aligned(odd) and torch.equal(aligned(odd), values.view(6, 10))
    staging = Staging()
    assert staging.ready(odd) is odd  # contiguous, same dtype: written as it is
    for cols in (slice(0, 5), slice(5, 10)):  # the two tp pieces of a column split share one realignment
        piece = staging.ready(odd[:, cols])
        assert piece.is_contiguous() and torch.equal(piece, values.view(6, 10)[:, cols])
    bf16 = staging.ready(odd.t(), torch.bfloat16)
    assert bf16.dtype == torch.bfloat16 and torch.equal(bf16, values.view(6, 10).t().to(torch.bfloat16))


def test_reshard_of_misaligned_input_is_exact_aligned_and_hashed_as_written(tmp_path, tokenizer_dir):
    cfg = tiny_llama(num_layers=2)
    make_checkpoint(tmp_path / "ck", cfg, tokenizer_dir)
    src = CheckpointSource(tmp_path / "ck")
    before = src.load(list(src.tensor_specs))
    raw = src.load(list(src.tensor_specs), raw=True)
    assert any(not is_aligned(t) for t in raw.values())  # DCP packs entries: this input exercises realignment
    run(["reshard", "--checkpoint", str(tmp_path / "ck"), "--output", str(tmp_path / "tp2"),
         "--tensor-parallel", "2", "--pipeline-parallel", "1", "--quiet"])
    out = CheckpointSource(tmp_path / "tp2")
    assert all(info.offset % 64 == 0 for info in out.metadata.storage_data.values())
    after = out.load(list(out.tensor_specs), raw=True)
    for k in before:
        assert is_aligned(after[k]) and torch.equal(before[k], after[k]), k
    assert "OK" in run_verify(tmp_path / "tp2")  # the sidecar's as-written digests match the files


def run_verify(path):
    from tessera.ckpt_convert.inspect import verify

    return verify(path, quiet=True)


def _as_format_1(ckpt_root):
    """Rewrite a checkpoint's sidecar as format 1 wrote it (SHA-256 digests, no algorithm field)."""
    directory = resolve_checkpoint(ckpt_root)
    raw = json.loads((directory / SIDECAR).read_text())
    raw["format_version"] = 1
    del raw["checksum_algorithm"]
    raw["checksums"] = {n: hashlib.sha256((directory / n).read_bytes()).hexdigest() for n in raw["checksums"]}
    (directory / SIDECAR).write_text(json.dumps(raw))
    return directory


def test_format_1_checkpoint_converts_and_its_corruption_is_caught(tmp_path, tokenizer_dir, capsys):
    make_checkpoint(tmp_path / "ck", tiny_llama(num_layers=2), tokenizer_dir)
    directory = _as_format_1(tmp_path / "ck")
    assert read_sidecar(directory).checksum_algorithm == "sha256"
    assert "OK" in run_verify(tmp_path / "ck")
    run(["reshard", "--checkpoint", str(tmp_path / "ck"), "--output", str(tmp_path / "tp2"),
         "--tensor-parallel", "2", "--pipeline-parallel", "1", "--quiet"])
    assert read_sidecar(resolve_checkpoint(tmp_path / "tp2")).checksum_algorithm == "xxh3-128"
    run(["export", "--format", "hf", "--checkpoint", str(tmp_path / "ck"), "--output", str(tmp_path / "hf"),
         "--quiet"])
    payload = next(directory.glob("*.distcp"))
    data = bytearray(payload.read_bytes())
    data[len(data) // 2] ^= 0xFF
    payload.write_bytes(bytes(data))
    for argv in (["verify", str(tmp_path / "ck"), "--quiet"],
                 ["export", "--format", "hf", "--checkpoint", str(tmp_path / "ck"), "--output", str(tmp_path / "x"),
                  "--quiet"]):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        err = capsys.readouterr().err.strip()
        assert exc.value.code == 2 and "checksum mismatch" in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "x").exists()


def test_truncated_safetensors_import_exit_2_no_output(tmp_path, tokenizer_dir, capsys):
    make_checkpoint(tmp_path / "ck", tiny_llama(num_layers=2), tokenizer_dir)
    run(["export", "--format", "hf", "--checkpoint", str(tmp_path / "ck"), "--output", str(tmp_path / "hf"),
         "--quiet"])
    weights = tmp_path / "hf" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(SystemExit) as exc:
        main(["import", "--format", "hf", "--input", str(tmp_path / "hf"), "--output", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and "truncated" in err and str(weights) in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))
