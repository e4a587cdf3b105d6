"""The checkpoint half of the corruption matrix: every (corruption, reader) pair is one line, exit 2.

One 2-step run is trained once; each corruption damages one copy of it, and every reader of a
checkpoint runs on that copy, in process (`run_cli`, as the console scripts do): `tessera-ckpt
info/verify/export/reshard`, `tessera-train --resume` and `checkpoint.init_from`,
`tessera-generate`, and `tessera-serve` up to the moment it would listen (uvicorn.Server.run is replaced
by a stub that fails the case: reaching it means the damage was accepted). A pair passes when the
command exits 2 with exactly one stderr line that names the damaged file, and wrote nothing.

Pairs that a reader legitimately does not read are listed in NOT_READ with the reason, and
asserted to succeed, so the list cannot hide a refusal that stopped happening or a crash.
The shard and mixture halves are in test_corruption_matrix.py.
"""

from __future__ import annotations

import json
import pickle
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import yaml
from conftest import train_two_steps

from tessera.common.checkpoint import POINTER, SIDECAR
from tessera.common.errors import run_cli

pytestmark = pytest.mark.slow
ITER = "iter_0000002"


def _payload(ckpt: Path) -> Path:
    return max(ckpt.glob("*.distcp"), key=lambda p: p.stat().st_size)


def payload_byte_flip(ckpt: Path) -> str:
    path = _payload(ckpt)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))
    return path.name


def truncated_payload(ckpt: Path) -> str:
    path = _payload(ckpt)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return path.name


def deleted_payload(ckpt: Path) -> str:
    path = _payload(ckpt)
    path.unlink()
    return path.name


def sidecar_model_edited(ckpt: Path) -> str:
    """The sidecar's model config no longer matches the stored tensors (hidden size doubled). The
    damage is a disagreement between two files, so the line names the checkpoint directory (and
    the tensor whose shape disagrees) rather than one of them."""
    sidecar = json.loads((ckpt / SIDECAR).read_text())
    sidecar["model"]["hidden_size"] *= 2
    (ckpt / SIDECAR).write_text(json.dumps(sidecar))
    return ckpt.name


def sidecar_not_json(ckpt: Path) -> str:
    path = ckpt / SIDECAR
    path.write_bytes(path.read_bytes()[:40])
    return SIDECAR


def metadata_truncated(ckpt: Path) -> str:
    path = ckpt / ".metadata"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return ".metadata"


def metadata_garbage(ckpt: Path) -> str:
    path = ckpt / ".metadata"
    path.write_bytes(bytes(range(256)) * (path.stat().st_size // 256 + 1))
    return ".metadata"


def pointer_to_missing_iteration(ckpt: Path) -> str:
    (ckpt.parent / POINTER).write_text("99\n")
    return POINTER


def pointer_not_utf8(ckpt: Path) -> str:
    """A pointer of bytes that are not UTF-8 (was UnicodeDecodeError's traceback in every reader)."""
    (ckpt.parent / POINTER).write_bytes(b"\xff\xfe2\n")
    return POINTER


def pointer_superscript_digit(ckpt: Path) -> str:
    """'²' passes str.isdigit() but not int() (was a ValueError traceback)."""
    (ckpt.parent / POINTER).write_text("\u00b2\n")
    return POINTER


def pointer_is_a_folder(ckpt: Path) -> str:
    """A folder under the pointer's name: read as 'no pointer', so --resume started over and the
    first save died replacing it (IsADirectoryError's traceback)."""
    (ckpt.parent / POINTER).unlink()
    (ckpt.parent / POINTER).mkdir()
    return POINTER


POINTER_CORRUPTIONS = (pointer_to_missing_iteration, pointer_not_utf8, pointer_superscript_digit, pointer_is_a_folder)


# ---- what the sidecar or the index says, against the files and the config (issues 28 and 35) ----
# The damage below keeps every checksum the sidecar lists valid (recomputed where a file changed),
# as an attacker who controls every file, or a tool that re-signs what it rewrote, would leave it.
Q_PROJ = "model.layers.0.attn.q_proj.weight"


def _edit_sidecar(ckpt: Path, edit: Callable[[dict], None]) -> None:
    sidecar = json.loads((ckpt / SIDECAR).read_text())
    edit(sidecar)
    (ckpt / SIDECAR).write_text(json.dumps(sidecar))


def _rewrite_payload(ckpt: Path, edit: Callable[[dict], None]) -> None:
    """The whole DCP payload saved again with `edit` applied to its tensors, checksums recomputed."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from tessera.common.checkpoint import (
        checkpoint_files,
        finalize_checkpoint,
        read_sidecar,
        single_process_dcp,
    )
    from tessera.common.safe_dcp import dcp_load, read_dcp_metadata

    index = read_dcp_metadata(ckpt).state_dict_metadata
    state = {k: torch.empty(md.size, dtype=md.properties.dtype) for k, md in index.items()
             if isinstance(md, TensorStorageMetadata)}
    assert len(state) == len(index)  # the trainer stores tensors only
    sidecar = read_sidecar(ckpt)
    with single_process_dcp():
        dcp_load(state, ckpt, no_dist=True)
        for path in checkpoint_files(ckpt):
            path.unlink()
        edit(state)
        dcp.save(state, checkpoint_id=str(ckpt), no_dist=True)
    finalize_checkpoint(ckpt, sidecar)


def _edit_index(ckpt: Path, key: str, shape: tuple[int, ...]) -> None:
    """`.metadata` claiming another shape for one (single-chunk) tensor, its checksum recomputed."""
    from tessera.common.fileio import file_digest
    from tessera.common.safe_dcp import read_dcp_metadata

    metadata = read_dcp_metadata(ckpt)
    entry = metadata.state_dict_metadata[key]
    entry.size = entry.chunks[0].sizes = torch.Size(shape)
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))
    _edit_sidecar(ckpt, lambda s: s["checksums"].update(
        {".metadata": file_digest(ckpt / ".metadata", s["checksum_algorithm"])}))


def unlisted_payload_flipped(ckpt: Path) -> str:
    """28.1: a payload file the sidecar's checksums do not list, with a flipped byte."""
    name = payload_byte_flip(ckpt)
    _edit_sidecar(ckpt, lambda s: s["checksums"].pop(name))
    return name


def empty_checksum_table(ckpt: Path) -> str:
    _edit_sidecar(ckpt, lambda s: s.update(checksums={}))
    return SIDECAR


def sidecar_lists_a_missing_file(ckpt: Path) -> str:
    """A wrong count: the sidecar lists one payload file more than the directory holds."""
    _edit_sidecar(ckpt, lambda s: s["checksums"].update({"__9_0.distcp": "0" * 32}))
    return "__9_0.distcp"


def q_proj_stored_as_int32(ckpt: Path) -> str:
    """35.7: a model tensor stored in a dtype the format does not allow (the index says so)."""
    _rewrite_payload(ckpt, lambda state: state.update({Q_PROJ: (state[Q_PROJ] * 100).to(torch.int32)}))
    return ".metadata"


def extra_model_tensor(ckpt: Path) -> str:
    _rewrite_payload(ckpt, lambda state: state.update({"model.extra.weight": torch.zeros(4, 4)}))
    return ".metadata"


def index_claims_huge_embedding(ckpt: Path) -> str:
    """35.6: the index claims a (10^6, 10^6) embedding (4 TB) over its kilobyte entry."""
    _edit_index(ckpt, "model.embed_tokens.weight", (10**6, 10**6))
    return ".metadata"


def index_shape_disagrees_with_config(ckpt: Path) -> str:
    """A header field (a shape) that fits its entry but not the sidecar's model config."""
    from tessera.common.safe_dcp import read_dcp_metadata

    rows, cols = read_dcp_metadata(ckpt).state_dict_metadata[Q_PROJ].size
    _edit_index(ckpt, Q_PROJ, (rows, cols // 2))
    return ".metadata"


def sidecar_claims_100k_layers(ckpt: Path) -> str:
    """35.6: a sidecar whose model would take gigabytes to even describe."""
    _edit_sidecar(ckpt, lambda s: s["model"].update(num_layers=100_000))
    return SIDECAR


def sidecar_layer_count_wrong(ckpt: Path) -> str:
    """A wrong count: one layer more in the sidecar than stored (the line names the directory)."""
    _edit_sidecar(ckpt, lambda s: s["model"].update(num_layers=s["model"]["num_layers"] + 1))
    return ckpt.name


def tokenizer_larger_than_model(ckpt: Path) -> str:
    """28.4: the checkpoint's tokenizer has more tokens (512) than the model's vocabulary (384)."""
    from trainer_fixtures import stdlib_documents, train_tokenizer

    shutil.rmtree(ckpt / "tokenizer")
    train_tokenizer(ckpt / "tokenizer", stdlib_documents(), vocab_size=512)
    return "tokenizer"


CORRUPTIONS: list[Callable[[Path], str]] = [
    payload_byte_flip, truncated_payload, deleted_payload, sidecar_model_edited, sidecar_not_json,
    metadata_truncated, metadata_garbage, pointer_to_missing_iteration, pointer_not_utf8, pointer_superscript_digit,
    pointer_is_a_folder,
    unlisted_payload_flipped, empty_checksum_table, sidecar_lists_a_missing_file, q_proj_stored_as_int32,
    extra_model_tensor, index_claims_huge_embedding, index_shape_disagrees_with_config, sidecar_claims_100k_layers,
    sidecar_layer_count_wrong, tokenizer_larger_than_model,
]
READERS = ["ckpt info", "ckpt verify", "ckpt export", "ckpt reshard", "train --resume", "train init_from",
           "generate", "serve"]

# (corruption, reader) pairs where the reader does not read the damaged bytes, and why.
NOT_READ = {
    ("payload_byte_flip", "ckpt info"): "info summarises the sidecar and the DCP index; it reads no payload "
                                        "bytes (verify does: `tessera-ckpt verify` is the integrity check)",
    ("tokenizer_larger_than_model", "ckpt info"): "info reads no tokenizer",
    ("tokenizer_larger_than_model", "train --resume"): "training reads data.tokenizer, not the checkpoint's copy",
    ("tokenizer_larger_than_model", "train init_from"): "training reads data.tokenizer, not the checkpoint's copy",
}


class _WouldServe(Exception):
    """Raised by the uvicorn.Server.run stub: tessera-serve accepted the checkpoint and would listen now."""


@pytest.fixture(scope="module")
def trained(tmp_path_factory, artifacts) -> tuple[dict, Path]:
    cfg, _, run = train_two_steps(artifacts, tmp_path_factory.mktemp("ckpt_matrix"))
    return cfg, run


@pytest.fixture(scope="module")
def damaged(trained, tmp_path_factory) -> Callable[[str], tuple[Path, str]]:
    """corruption name -> (a damaged copy of the run, the damaged file's name); one copy per corruption."""
    copies: dict[str, tuple[Path, str]] = {}

    def get(name: str) -> tuple[Path, str]:
        if name not in copies:
            run = tmp_path_factory.mktemp(name) / "run"
            shutil.copytree(trained[1], run)
            copies[name] = run, globals()[name](run / "checkpoints" / ITER)
        return copies[name]

    return get


def _command(reader: str, cfg: dict, run: Path, out: Path, pointer: bool) -> Callable[[], None]:
    """The reader's CLI call, in process. With `pointer`, readers are given the run (or checkpoints)
    directory so that they follow the pointer; otherwise the iteration directory itself."""
    from tessera.ckpt_convert.cli import run as ckpt_run
    from tessera.inference.entrypoints.generate_cli import main as generate_main
    from tessera.inference.entrypoints.serve_cli import main as serve_main
    from tessera.trainer.cli import main as train_main

    ckpt = str(run if pointer else run / "checkpoints" / ITER)
    out.mkdir(parents=True, exist_ok=True)
    config = out / "config.yaml"
    config.write_text(yaml.safe_dump({**cfg, "run_dir": str(run)}))
    prompts = out / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "def f"}) + "\n")
    argv = {
        "ckpt info": (ckpt_run, ["info", ckpt]),
        "ckpt verify": (ckpt_run, ["verify", ckpt]),
        "ckpt export": (ckpt_run, ["export", "--format", "hf", "--checkpoint", ckpt, "--output", str(out / "hf"),
                                   "--quiet"]),
        "ckpt reshard": (ckpt_run, ["reshard", "--checkpoint", ckpt, "--output", str(out / "tp2"),
                                    "--tensor-parallel", "2", "--pipeline-parallel", "1", "--quiet"]),
        "train --resume": (train_main, ["--config", str(config), "--resume", "--quiet", "training.steps=3"]),
        "train init_from": (train_main, ["--config", str(config), f"run_dir={out / 'new'}", "--quiet",
                                         f"checkpoint.init_from={run / 'checkpoints' if pointer else ckpt}",
                                         "training.steps=1"]),
        "generate": (generate_main, ["--checkpoint", ckpt, "--prompts", str(prompts), "--output",
                                     str(out / "out.jsonl"), "--max-tokens", "2", "--quiet"]),
        "serve": (serve_main, ["--checkpoint", ckpt, "--port", "8", "--quiet"]),
    }[reader]
    return lambda: run_cli(*argv)


def _outputs(run: Path, out: Path) -> list[Path]:
    """What a refused command must not have written: an export, a reshard, generations, a new
    checkpoint, or a metrics record. (init_from's new run gets its folders, config.yaml and an
    empty metrics.jsonl before the checkpoint is read: the record of a run that did not start.)"""
    made = [out / name for name in ("hf", "tp2", "out.jsonl") if (out / name).exists()]
    made += [p for p in (out / "new").rglob("*") if p.is_file() and p.name not in ("config.yaml", "metrics.jsonl")]
    made += [p for p in (out / "new").glob("metrics.jsonl") if p.read_text().strip()]
    made += list((out / "new").glob("checkpoints/iter_*"))
    return made + [p for p in (run / "checkpoints").glob("iter_*") if p.name != ITER]


@pytest.fixture
def no_listening(monkeypatch):
    import uvicorn

    def stub(*args, **kwargs):
        raise _WouldServe

    monkeypatch.setattr(uvicorn.Server, "run", stub)  # serve_cli runs a uvicorn.Server (it reports the bound port)


@pytest.mark.parametrize("reader", READERS)
@pytest.mark.parametrize("corruption", CORRUPTIONS, ids=lambda f: f.__name__)
def test_every_checkpoint_corruption_is_refused_by_every_reader(corruption, reader, trained, damaged, tmp_path,
                                                               capsys, no_listening):
    run, damaged_file = damaged(corruption.__name__)
    out = tmp_path / "out"
    command = _command(reader, trained[0], run, out, pointer=corruption in POINTER_CORRUPTIONS)
    capsys.readouterr()
    if (corruption.__name__, reader) in NOT_READ:
        private = tmp_path / "private"  # a reader that succeeds may write (a resumed run saves)
        shutil.copytree(run, private)
        command = _command(reader, trained[0], private, out, pointer=corruption in POINTER_CORRUPTIONS)
        with pytest.raises(SystemExit) as exc:
            command()
        assert exc.value.code == 0, capsys.readouterr().err[-2000:]
        return
    with pytest.raises(SystemExit) as exc:
        try:
            command()
        except _WouldServe:
            pytest.fail(f"tessera-serve accepted a checkpoint with {corruption.__name__} and would listen")
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert exc.value.code == 2, f"exit {exc.value.code}; stderr:\n{err[-3000:]}"
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    assert damaged_file in lines[0], lines[0]
    assert not _outputs(run, out), _outputs(run, out)

