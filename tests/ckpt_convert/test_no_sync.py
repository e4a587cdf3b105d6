"""--no-sync: the same bytes as the durable default, and no fsync / early writeback at all."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest
from ckpt_helpers import make_checkpoint, tiny_llama
from test_reshard_import import optimizer_state

import tessera.ckpt_convert.mapped as mapped
from tessera.ckpt_convert.cli import run
from tessera.common.checkpoint import SIDECAR


def tree(root: Path) -> dict[str, object]:
    """Every file under root (relative path -> bytes), except what differs between any two runs,
    durable or not: DCP's `.metadata` records a random save id and the (temporary) directory it was
    written to, so it is compared unpickled without those, and the sidecar without its checksum and
    its creation time (seconds: two runs can straddle a second)."""
    out: dict[str, object] = {}
    for p in sorted(root.rglob("*")):
        if not p.is_file():
            continue
        name = str(p.relative_to(root))
        if p.name == ".metadata":
            with open(p, "rb") as f:
                md = pickle.load(f)
            assert md.storage_meta is not None
            md.storage_meta = None
            out[name] = pickle.dumps(md)
        elif p.name == SIDECAR:
            side = json.loads(p.read_text())
            assert side["checksums"].pop(".metadata")
            assert side.pop("created_at")
            out[name] = side
        else:
            out[name] = p.read_bytes()
    return out


@pytest.fixture(scope="module")
def sources(tmp_path_factory, tokenizer_dir) -> dict[str, Path]:
    """A checkpoint with training state and tokenizer, and its HF export (import's input)."""
    root = tmp_path_factory.mktemp("nosync-src")
    cfg = tiny_llama(num_layers=4, num_heads=4, num_kv_heads=2)
    make_checkpoint(root / "ck", cfg, tokenizer_dir, extra=optimizer_state(cfg))
    run(["export", "--format", "hf", "--checkpoint", str(root / "ck"), "--output", str(root / "hf"), "--quiet"])
    return {"ck": root / "ck", "hf": root / "hf"}


def verbs(sources: dict[str, Path], out: Path) -> dict[str, list[str]]:
    ck, hf = str(sources["ck"]), str(sources["hf"])
    return {
        "reshard": ["reshard", "--checkpoint", ck, "--output", str(out / "reshard"), "--tensor-parallel", "2",
                    "--pipeline-parallel", "2", "--data-parallel", "2"],
        "export-hf": ["export", "--format", "hf", "--checkpoint", ck, "--output", str(out / "hf")],
        # Sharded: several safetensors files (the background fsync path) plus the index.
        "export-hf-sharded": ["export", "--format", "hf", "--checkpoint", ck, "--output", str(out / "hf-sharded"),
                              "--max-shard-size", "100KB"],
        "export-trtllm": ["export", "--format", "trtllm", "--checkpoint", ck, "--output", str(out / "trt"),
                          "--tensor-parallel", "2", "--pipeline-parallel", "2"],
        "import": ["import", "--format", "hf", "--input", hf, "--output", str(out / "imported")],
    }


@pytest.fixture
def kernel_copy_everything(monkeypatch):
    """Tiny tensors take the same paths as large ones: file-to-file copies for any size, and early
    writeback after every write (counted, never really issued)."""
    calls = {"sync_file_range": 0}

    def fake_sync_file_range(*args):
        calls["sync_file_range"] += 1
        return 0

    monkeypatch.setattr(mapped, "_MIN_KERNEL_COPY", 1)
    monkeypatch.setattr(mapped, "WRITEBACK_STEP", 1)
    monkeypatch.setattr(mapped, "_sync_file_range", lambda: fake_sync_file_range)
    return calls


@pytest.mark.parametrize("verb", ["reshard", "export-hf", "export-hf-sharded", "export-trtllm", "import"])
def test_no_sync_output_bit_identical(tmp_path, sources, kernel_copy_everything, verb):
    durable = verbs(sources, tmp_path / "durable")[verb]
    fast = verbs(sources, tmp_path / "nosync")[verb]
    assert run([*durable, "--quiet"]) == 0
    assert run([*fast, "--quiet", "--no-sync"]) == 0
    a, b = tree(Path(durable[durable.index("--output") + 1])), tree(Path(fast[fast.index("--output") + 1]))
    assert sorted(a) == sorted(b)
    assert len(a) >= 3
    for name in a:
        assert a[name] == b[name], name
    assert not [p for p in (tmp_path / "nosync").iterdir() if p.name.startswith(".")]  # no temporaries left


@pytest.mark.parametrize("verb", ["reshard", "export-hf", "export-hf-sharded", "export-trtllm", "import"])
def test_no_sync_never_fsyncs(tmp_path, sources, kernel_copy_everything, monkeypatch, verb):
    """Counted in-process: os.fsync (files and directories) and sync_file_range (early writeback)."""
    fsyncs: list[int] = []
    real_fsync = os.fsync

    def counting_fsync(fd):
        fsyncs.append(fd)
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", counting_fsync)
    cmd = verbs(sources, tmp_path)[verb]
    assert run([*cmd, "--quiet", "--no-sync"]) == 0
    assert fsyncs == [] and kernel_copy_everything["sync_file_range"] == 0
    # The default (durable) run of the same verb does fsync, and starts early writeback.
    cmd = verbs(sources, tmp_path / "durable")[verb]
    assert run([*cmd, "--quiet"]) == 0
    assert len(fsyncs) >= 3 and kernel_copy_everything["sync_file_range"] > 0


def test_no_sync_still_atomic_on_failure(tmp_path, sources, monkeypatch):
    """A failure mid-conversion leaves nothing under the output name or beside it, as with sync."""
    import tessera.ckpt_convert.dcp_writer as dcp_writer

    def boom(*args, **kwargs):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(dcp_writer.ShardedDcpWriter, "write_bytes", boom)
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="disk on fire"):
        run(["reshard", "--checkpoint", str(sources["ck"]), "--output", str(out), "--tensor-parallel", "2",
             "--pipeline-parallel", "1", "--quiet", "--no-sync"])
    assert list(tmp_path.iterdir()) == []


def test_no_sync_not_on_read_only_verbs(tmp_path, sources, capsys):
    from tessera.common.errors import UserError

    with pytest.raises(UserError, match="--no-sync"):
        run(["verify", str(sources["ck"]), "--no-sync"])
