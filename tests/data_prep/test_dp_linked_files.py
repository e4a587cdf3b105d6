"""tessera-data reads a shard's files and a tokenizer's files only from inside their folder: a
link that leads elsewhere is refused in one line, exit 2, by every command that reads them."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from dp_helpers import user_error, write_jsonl


@pytest.fixture()
def shard(tmp_path, base_shard) -> Path:
    (tmp_path / "data").mkdir()
    for suffix in (".bin", ".idx", ".json"):
        shutil.copyfile(f"{base_shard}{suffix}", tmp_path / "data" / f"s{suffix}")
    return tmp_path / "data" / "s"


def _argv(command: str, shard: Path, out: Path) -> list:
    return {
        "verify": ["verify", shard],
        "inspect": ["inspect", shard],
        "merge": ["merge", "--inputs", shard, "--output-prefix", out, "--quiet"],
        "blend": ["blend", "--data", "1.0", shard, "--seq-length", "32", "--split", "8,2,0", "--train-samples", "40",
                  "--valid-samples", "4", "--output", out, "--quiet"],
    }[command]


@pytest.mark.parametrize("command", ["verify", "inspect", "merge", "blend"])
@pytest.mark.parametrize("suffix", [".bin", ".idx", ".json"])
def test_a_shard_file_linked_outside_its_folder_is_refused_by_every_reader(shard, tmp_path, capsys, command, suffix):
    """The very file, moved out of the folder and linked back: its content is right, its place is not."""
    path = Path(f"{shard}{suffix}")
    path.rename(tmp_path / f"elsewhere{suffix}")
    path.symlink_to(tmp_path / f"elsewhere{suffix}")
    line = user_error(_argv(command, shard, tmp_path / "out"), capsys)
    assert f"s{suffix}: leads outside" in line, line
    assert not list(tmp_path.glob("out*"))


def test_a_loss_mask_linked_outside_its_folder_is_refused(shard, tmp_path, capsys):
    Path(f"{shard}.mask.bin").symlink_to("/dev/zero")
    assert "s.mask.bin: leads outside" in user_error(["verify", shard], capsys)


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                                  "chat_template.jinja"])
def test_prep_refuses_a_tokenizer_file_linked_outside_its_folder(tokenizer_dir, tmp_path, capsys, name):
    tok = tmp_path / "tok"
    shutil.copytree(tokenizer_dir, tok)
    secret = tmp_path / "secret"
    if (tok / name).exists():
        (tok / name).rename(secret)
    else:
        secret.write_text("{{ messages }}")
    (tok / name).symlink_to(secret)
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"text": "hello"}])
    line = user_error(["prep", "--input", corpus, "--tokenizer", tok, "--output-prefix", tmp_path / "out/x",
                       "--quiet"], capsys)
    assert f"{name}: leads outside" in line, line
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())


@pytest.mark.parametrize("kind", ["pipe", "link loop"])
def test_prep_refuses_a_tokenizer_file_that_is_a_pipe_or_a_loop_of_links(tokenizer_dir, tmp_path, capsys, kind):
    import os

    tok = tmp_path / "tok"
    shutil.copytree(tokenizer_dir, tok)
    if kind == "pipe":  # reading it would block forever
        os.mkfifo(tok / "chat_template.jinja")
    else:
        (tok / "chat_template.jinja").symlink_to(tok / "other")
        (tok / "other").symlink_to(tok / "chat_template.jinja")
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"text": "hello"}])
    line = user_error(["prep", "--input", corpus, "--tokenizer", tok, "--output-prefix", tmp_path / "out/x",
                       "--quiet"], capsys)
    assert "chat_template.jinja: " in line and ("not a regular file" if kind == "pipe" else "loop") in line, line


def test_prep_refuses_a_tokenizer_config_that_is_not_utf8_in_one_line(tokenizer_dir, tmp_path, capsys):
    tok = tmp_path / "tok"
    shutil.copytree(tokenizer_dir, tok)
    (tok / "tokenizer_config.json").write_bytes(b'{"eos_token": "\xff"}')
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"text": "hello"}])
    line = user_error(["prep", "--input", corpus, "--tokenizer", tok, "--output-prefix", tmp_path / "out/x",
                       "--quiet"], capsys)
    assert "tokenizer_config.json: not valid JSON" in line, line


def test_a_snapshots_folder_that_is_not_a_hub_cache_lends_no_exception_for_links(tokenizer_dir, tmp_path, capsys):
    """Only a hub cache repository (`models--org--name/snapshots/<rev>`) may link into its `blobs/`:
    a backup's `snapshots/` folder beside some `blobs/` folder is an ordinary place."""
    tok = tmp_path / "backup" / "snapshots" / "r1" / "tok"
    shutil.copytree(tokenizer_dir, tok)
    (tmp_path / "backup" / "blobs").mkdir()
    (tmp_path / "backup" / "blobs" / "secret").write_text("{{ messages }}")
    (tok / "chat_template.jinja").symlink_to("../../../blobs/secret")
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"text": "hello"}])
    line = user_error(["prep", "--input", corpus, "--tokenizer", tok, "--output-prefix", tmp_path / "out/x",
                       "--quiet"], capsys)
    assert "chat_template.jinja: leads outside" in line, line
