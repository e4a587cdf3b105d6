"""Artifact files are read only from inside their folder: a chat template linked to a file
elsewhere (`ln -s /proc/self/environ hf/chat_template.jinja`) once reached any client through
/tokenize + /detokenize. Now the server refuses such a model at start, in one line; a Hugging
Face hub cache snapshot, whose files are links into its repository's `blobs/`, still serves."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import torch
from ports import SERVE, start_serve

from tessera.common.errors import ArtifactError, run_cli
from tessera.inference.worker.loader import load_for_serving

SECRET = "TESSERA-SECRET-d41d8cd98f00"


@pytest.fixture(scope="module")
def hf_export(tiny_ckpt, tmp_path_factory) -> Path:
    from tessera.ckpt_convert.cli import main as ckpt_main

    out = tmp_path_factory.mktemp("export") / "hf"
    with pytest.raises(SystemExit) as exc:
        run_cli(ckpt_main, ["export", "--format", "hf", "--checkpoint", str(tiny_ckpt), "--output", str(out),
                            "--quiet", "--no-sync"])
    assert exc.value.code == 0
    return out


def _with_linked_template(hf_export: Path, tmp_path: Path) -> Path:
    """A copy of the export whose chat template is a link to a secret file outside it."""
    secret = tmp_path / "secret.txt"
    secret.write_text(SECRET)
    hf = tmp_path / "hf"
    shutil.copytree(hf_export, hf)
    (hf / "chat_template.jinja").unlink(missing_ok=True)
    (hf / "chat_template.jinja").symlink_to(secret)
    return hf


def _serves(proc: subprocess.Popen, url: str, timeout: float) -> bool:
    """True once /health answers 200; False when the process exits first."""
    deadline = time.monotonic() + timeout
    while proc.poll() is None:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the server neither started nor exited"
        time.sleep(0.2)
    return False


@pytest.mark.slow
def test_a_chat_template_linked_outside_the_model_is_refused_at_start_and_never_reaches_a_client(
        hf_export, tmp_path):
    hf = _with_linked_template(hf_export, tmp_path)
    proc, url, lines = start_serve(SERVE, "--checkpoint", hf, "--quiet", "--num-kv-blocks", "32", timeout=120,
                                   must_start=False)
    try:
        if url is not None and _serves(proc, url, 120):  # the old code served it: the leak, as an attacker reads it
            ids = httpx.post(url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]},
                             timeout=30).json()["tokens"]
            text = httpx.post(url + "/detokenize", json={"tokens": ids}, timeout=30).json()["prompt"]
            assert SECRET not in text, "the linked file reached a client"
            pytest.fail("the server started with a chat template linked outside its directory")
        code = proc.wait(timeout=60)
        err = "".join(lines) + proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err[-2000:]
    assert "chat_template.jinja" in lines[0] and "outside" in lines[0] and SECRET not in err, lines[0]


def test_every_file_of_an_hf_directory_is_refused_when_it_links_outside(hf_export, tmp_path):
    """config.json, generation_config.json, the weights and each tokenizer file, each in turn."""
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                 "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        hf = tmp_path / name / "hf"
        shutil.copytree(hf_export, hf)
        outside = tmp_path / name / "elsewhere"
        if (hf / name).exists():
            (hf / name).rename(outside)  # the very file, only moved out: still refused
        else:
            outside.write_text("{}")
        (hf / name).symlink_to(outside)
        with pytest.raises(ArtifactError, match=rf"{name}: leads outside"):
            load_for_serving(hf, torch.device("cpu"), torch.float32)


def test_a_checkpoint_whose_tokenizer_folder_links_outside_is_refused(tiny_ckpt, tmp_path):
    from tessera.common.checkpoint import resolve_checkpoint

    ckpt = tmp_path / "iter_0000001"
    shutil.copytree(resolve_checkpoint(tiny_ckpt), ckpt)
    (ckpt / "tokenizer").rename(tmp_path / "tokenizer")
    (ckpt / "tokenizer").symlink_to(tmp_path / "tokenizer")
    with pytest.raises(ArtifactError, match=r"tokenizer: leads outside"):
        load_for_serving(ckpt, torch.device("cpu"), torch.float32)


def hub_cache_snapshot(source: Path, cache: Path, name: str = "models--tessera--tiny") -> Path:
    """`source`'s files laid out as huggingface_hub's cache does: each snapshot file a relative
    link to a content-addressed blob of the same repository."""
    repo = cache / name
    snapshot = repo / "snapshots" / ("0" * 40)
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    for f in sorted(source.iterdir()):
        digest = hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copyfile(f, repo / "blobs" / digest)
        (snapshot / f.name).symlink_to(Path("..") / ".." / "blobs" / digest)
    return snapshot


def test_a_hugging_face_hub_cache_snapshot_still_serves(hf_export, tmp_path):
    snapshot = hub_cache_snapshot(hf_export, tmp_path / "hub")
    assert all(p.is_symlink() for p in snapshot.iterdir())
    loaded = load_for_serving(snapshot, torch.device("cpu"), torch.float32)
    direct = load_for_serving(hf_export, torch.device("cpu"), torch.float32)
    assert loaded.tokenizer.chat_template == direct.tokenizer.chat_template
    for (name, a), (_, b) in zip(loaded.model.state_dict().items(), direct.model.state_dict().items()):
        assert torch.equal(a, b), name
    # A blob that is itself a link out of the cache is still refused.
    blob = (snapshot / "tokenizer_config.json").resolve()
    secret = tmp_path / "secret.json"
    secret.write_text("{}")
    os.unlink(blob)
    blob.symlink_to(secret)
    with pytest.raises(ArtifactError, match=r"tokenizer_config.json: leads outside"):
        load_for_serving(snapshot, torch.device("cpu"), torch.float32)
