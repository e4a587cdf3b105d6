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
from tessera.ckpt_convert.mapped import (
    RangeReader,
    Staging,
    aligned,
    file_region,
    is_aligned,
    load_saved_tensor,
    map_bytes,
    write_bytes,
)
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
        # The plain read of the same entry (the fallback) goes through the same one range reader.
        with open(path, "rb", buffering=0) as f:
            plain = torch.load(RangeReader(f.fileno(), offset, length), map_location="cpu", weights_only=True)
        assert plain.stride() == t.stride() and torch.equal(plain, t)


def test_staging_realigns_and_materialises():
    values = torch.arange(60, dtype=torch.float32)
    raw = bytearray(values.numel() * 4 + 1)
    memoryview(raw)[1:] = values.numpy().tobytes()
    odd = torch.frombuffer(memoryview(raw)[1:], dtype=torch.float32).view(6, 10)  # misaligned elements
    assert not is_aligned(odd) and torch.equal(aligned(odd), values.view(6, 10))
    staging = Staging()
    assert staging.ready(odd) is odd  # contiguous, same dtype: written as it is
    for cols in (slice(0, 5), slice(5, 10)):  # the tp pieces of a column split: copied row by row as bytes
        piece = staging.ready(odd[:, cols])
        assert piece.is_contiguous() and torch.equal(piece, values.view(6, 10)[:, cols])
    # A transpose and a dtype conversion compute on the elements: realigned first (once per tensor).
    assert torch.equal(staging.ready(odd.t()), values.view(6, 10).t())
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


def test_write_bytes_copies_mapped_regions_in_the_kernel(tmp_path):
    blob = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    (tmp_path / "in").write_bytes(bytes(blob.numpy()))
    view = map_bytes(tmp_path / "in", 12345, 2 << 20)  # odd offset: not page aligned
    assert file_region(view) == (str(tmp_path / "in"), 12345)
    assert file_region(view[100:200]) == (str(tmp_path / "in"), 12445)
    assert file_region(bytearray(10)) is None
    with open(tmp_path / "out", "wb") as f:
        f.write(b"head")
        assert write_bytes(f, view) == 2 << 20  # kernel copy
        write_bytes(f, b"tail")  # plain write, after it
        assert f.tell() == 4 + (2 << 20) + 4
    expect = b"head" + bytes(blob[12345:12345 + (2 << 20)].numpy()) + b"tail"
    assert (tmp_path / "out").read_bytes() == expect


def test_large_tensors_round_trip_through_kernel_copies(tmp_path, tokenizer_dir):
    """Tensors over the kernel-copy threshold (embedding 2 MiB): reshard and export carry them exactly."""
    from safetensors.torch import load_file

    cfg = tiny_llama(num_layers=2, vocab_size=2048, hidden_size=256, num_heads=4, num_kv_heads=2,
                     ffn_hidden_size=512)
    make_checkpoint(tmp_path / "ck", cfg, tokenizer_dir)
    before = CheckpointSource(tmp_path / "ck").load_model(["embed_tokens.weight", "lm_head.weight"])
    assert before["embed_tokens.weight"].nbytes >= 2 << 20
    run(["reshard", "--checkpoint", str(tmp_path / "ck"), "--output", str(tmp_path / "tp2"),
         "--tensor-parallel", "2", "--pipeline-parallel", "1", "--quiet"])
    after = CheckpointSource(tmp_path / "tp2").load_model(list(before))
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert "OK" in run_verify(tmp_path / "tp2")
    run(["export", "--format", "hf", "--checkpoint", str(tmp_path / "tp2"), "--output", str(tmp_path / "hf"),
         "--quiet"])
    hf = load_file(tmp_path / "hf" / "model.safetensors")
    assert torch.equal(hf["model.embed_tokens.weight"], before["embed_tokens.weight"])
    assert torch.equal(hf["lm_head.weight"], before["lm_head.weight"])
    run(["import", "--format", "hf", "--input", str(tmp_path / "hf"), "--output", str(tmp_path / "back"),
         "--quiet", "--vocab-size-divisible-by", "1"])  # an identity round trip: the original is unpadded
    back = CheckpointSource(tmp_path / "back").load_model(list(before))
    assert all(torch.equal(before[k], back[k]) for k in before)
    assert "OK" in run_verify(tmp_path / "back")


def test_early_writeback_hands_each_written_range_to_the_kernel_once(tmp_path, monkeypatch):
    """write_bytes asks for asynchronous writeback of every WRITEBACK_STEP written, in order, each
    byte once, and the file's bytes are unchanged by it."""
    import os

    from tessera.ckpt_convert import mapped

    calls = []
    real = mapped._sync_file_range()
    assert real is not None  # Linux: the call exists (else conversions still work, see below)

    def record(fd, offset, count, flags):
        calls.append((os.fstat(fd).st_ino, offset, count, flags))
        return real(fd, offset, count, flags)

    monkeypatch.setattr(mapped, "WRITEBACK_STEP", 1000)
    monkeypatch.setattr(mapped, "_sync_file_range", lambda: record)
    data = bytes(range(256)) * 20
    with open(tmp_path / "out", "wb") as f:
        for i in range(0, len(data), 300):
            write_bytes(f, data[i:i + 300])
        ino = os.fstat(f.fileno()).st_ino
    assert (tmp_path / "out").read_bytes() == data
    ranges = [(off, n) for i, off, n, flags in calls if i == ino and flags == 2]
    assert ranges and ranges[0][0] == 0 and all(n >= 1000 for _, n in ranges)
    assert all(a + n == b for (a, n), (b, _) in zip(ranges, ranges[1:]))  # contiguous, no byte twice
    assert len(data) - (ranges[-1][0] + ranges[-1][1]) < 1000  # the rest is left to the fsync


@pytest.mark.parametrize("sync_file_range", ["recording", "missing", "failing"])
def test_conversions_exact_with_early_writeback_used_missing_or_failing(tmp_path, tokenizer_dir, monkeypatch,
                                                                       sync_file_range):
    """Early writeback is a hint: whether the kernel call runs (every few KiB here), does not exist,
    or fails, reshard / export / import write the same verified bytes."""
    from safetensors.torch import load_file

    from tessera.ckpt_convert import mapped

    calls = []
    fn = {"recording": lambda *a: calls.append(a) or 0, "missing": None, "failing": lambda *a: -1}[sync_file_range]
    monkeypatch.setattr(mapped, "WRITEBACK_STEP", 4096)
    monkeypatch.setattr(mapped, "_sync_file_range", lambda: fn)
    cfg = tiny_llama(num_layers=2)
    make_checkpoint(tmp_path / "ck", cfg, tokenizer_dir)
    before = CheckpointSource(tmp_path / "ck").load(list(CheckpointSource(tmp_path / "ck").tensor_specs))
    run(["reshard", "--checkpoint", str(tmp_path / "ck"), "--output", str(tmp_path / "tp2"),
         "--tensor-parallel", "2", "--pipeline-parallel", "2", "--quiet"])
    out = CheckpointSource(tmp_path / "tp2")
    after = out.load(list(out.tensor_specs))
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert "OK" in run_verify(tmp_path / "tp2")
    run(["export", "--format", "hf", "--checkpoint", str(tmp_path / "tp2"), "--output", str(tmp_path / "hf"),
         "--quiet"])
    hf = load_file(tmp_path / "hf" / "model.safetensors")
    assert torch.equal(hf["model.embed_tokens.weight"], before["model.embed_tokens.weight"])
    run(["export", "--format", "trtllm", "--checkpoint", str(tmp_path / "ck"), "--output", str(tmp_path / "trt"),
         "--tensor-parallel", "2", "--quiet"])
    trt = load_file(tmp_path / "trt" / "rank1.safetensors")
    assert torch.equal(trt["transformer.vocab_embedding.weight"], before["model.embed_tokens.weight"])
    run(["import", "--format", "hf", "--input", str(tmp_path / "hf"), "--output", str(tmp_path / "back"),
         "--quiet", "--vocab-size-divisible-by", "1"])  # an identity round trip: the original is unpadded
    back = CheckpointSource(tmp_path / "back")
    got = back.load(list(back.tensor_specs))
    assert all(torch.equal(before[k], got[k]) for k in got)
    assert "OK" in run_verify(tmp_path / "back")
    assert (len(calls) > 0) == (sync_file_range == "recording")


def test_hf_weights_are_maps_of_the_file_for_import_and_serving_alike(tmp_path, tokenizer_dir):
    """The one HF directory reader (tessera.common.hf, used by `import` and by the server) gives
    each tensor as a map of its bytes in model.safetensors, equal to what safetensors reads."""
    from safetensors.torch import load_file

    from tessera.ckpt_convert.mapped import raw
    from tessera.common.hf.directory import SafetensorsWeights

    make_checkpoint(tmp_path / "ck", tiny_llama(num_layers=2), tokenizer_dir)
    run(["export", "--format", "hf", "--checkpoint", str(tmp_path / "ck"), "--output", str(tmp_path / "hf"),
         "--quiet"])
    weights = SafetensorsWeights(tmp_path / "hf")
    expected = load_file(tmp_path / "hf" / "model.safetensors")
    assert weights.names() == set(expected)
    for name, want in expected.items():
        got = weights.get(name)
        assert got.dtype == weights.dtype(name) == want.dtype and got.shape == weights.shape(name) == want.shape
        assert torch.equal(got, want), name
        assert not got.untyped_storage().resizable()  # memory of the file map, not a fresh buffer
        path, offset = file_region(raw(got))
        assert path == str(tmp_path / "hf" / "model.safetensors") and offset > 8
