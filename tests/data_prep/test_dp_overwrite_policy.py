"""`tessera-data ... --overwrite` replaces only what the verb itself would have written: shards,
a shard manifest, a trained tokenizer, a mixture (fileio.check_replaceable). A user's file that
happens to sit at the output's name is refused in one line (exit 2) and left as it was."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from dp_helpers import run, user_error, write_jsonl

from tessera.common.shard import read_shard_manifest

MINE = b'{"name": "my notes, not a shard"}\n'


def _corpus(tmp_path: Path, texts: list[str]) -> Path:
    return write_jsonl(tmp_path / "c.jsonl", [{"text": t} for t in texts[:6]])


def test_prep_refuses_a_user_file_at_a_shard_name_and_replaces_its_own_shards(tmp_path, tokenizer_dir, corpus_texts,
                                                                             capsys):
    corpus = _corpus(tmp_path, corpus_texts)
    prep = ["prep", "--input", corpus, "--tokenizer", tokenizer_dir, "--output-prefix", tmp_path / "o/x", "--quiet"]
    (tmp_path / "o").mkdir()
    theirs = tmp_path / "o/x_text_document.json"
    theirs.write_bytes(MINE)
    err = user_error([*prep, "--overwrite"], capsys)
    assert f"{theirs} exists and is not a shard" in err and "remove it yourself" in err, err
    assert theirs.read_bytes() == MINE and sorted(p.name for p in (tmp_path / "o").iterdir()) == [theirs.name]
    theirs.unlink()
    lone = tmp_path / "o/x_text_document.bin"  # a .bin with no index beside it: not recognised
    lone.write_bytes(b"\x01" * 32)
    err = user_error([*prep, "--overwrite"], capsys)
    assert f"{lone} exists and is not a shard" in err, err
    assert lone.read_bytes() == b"\x01" * 32
    lone.unlink()

    # Its own earlier output, split into numbered shards, is replaced whole by a single shard.
    run([*prep, "--max-shard-size", "2000"])
    assert len(list((tmp_path / "o").glob("x_text_document_*.idx"))) > 1
    run([*prep, "--overwrite"])
    assert sorted(p.name for p in (tmp_path / "o").iterdir()) == [f"x_text_document.{s}" for s in ("bin", "idx", "json")]
    # What an interrupted run leaves (an .idx whose .bin and manifest are gone) is replaced too.
    (tmp_path / "o/x_text_document.bin").unlink()
    (tmp_path / "o/x_text_document.json").unlink()
    run([*prep, "--overwrite"])
    run(["verify", tmp_path / "o/x_text_document"])


def test_prep_tokenizer_output_of_other_files_is_refused_and_its_own_tokenizer_replaced(tmp_path, corpus_texts,
                                                                                       capsys):
    corpus = _corpus(tmp_path, corpus_texts)
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("keep me")
    train = ["prep", "--input", corpus, "--train-tokenizer", "--vocab-size", 300, "--output-prefix", tmp_path / "o/x",
             "--quiet"]
    err = user_error([*train, "--tokenizer-output", notes, "--overwrite"], capsys)
    assert f"--tokenizer-output {notes}: holds 1 files or folders that are not a tokenizer folder" in err, err
    assert [p.name for p in notes.iterdir()] == ["todo.txt"] and (notes / "todo.txt").read_text() == "keep me"
    assert not (tmp_path / "o").exists() or not any((tmp_path / "o").iterdir())
    run([*train, "--tokenizer-output", tmp_path / "tok"])
    (tmp_path / "tok" / "left-over").write_text("x")
    run([*train, "--tokenizer-output", tmp_path / "tok", "--overwrite"])
    assert (tmp_path / "tok" / "tokenizer.json").is_file() and not (tmp_path / "tok" / "left-over").exists()


def test_blend_refuses_a_folder_of_other_files_and_replaces_its_own_mixture(tmp_path, base_shard, capsys):
    blend = ["blend", "--data", base_shard, "--seq-length", 16, "--train-samples", 4, "--quiet"]
    home = tmp_path / "home"
    (home / "docs").mkdir(parents=True)
    (home / "a.txt").write_bytes(MINE)
    err = user_error([*blend, "--output", home, "--overwrite"], capsys)
    assert f"--output {home}: holds 2 files or folders that are not a mixture directory" in err, err
    assert sorted(p.name for p in home.iterdir()) == ["a.txt", "docs"] and (home / "a.txt").read_bytes() == MINE
    link = tmp_path / "link"
    link.symlink_to(home)
    err = user_error([*blend, "--output", link, "--overwrite"], capsys)
    assert f"--output {link}: is a symbolic link" in err, err
    assert link.is_symlink() and (home / "a.txt").read_bytes() == MINE

    run([*blend, "--output", tmp_path / "mix"])
    first = (tmp_path / "mix/manifest.json").read_bytes()
    (tmp_path / "mix/left-over").write_text("x")
    run([*blend, "--output", tmp_path / "mix", "--overwrite"])
    assert (tmp_path / "mix/manifest.json").read_bytes() == first and not (tmp_path / "mix/left-over").exists()
    (tmp_path / "empty").mkdir()
    run([*blend, "--output", tmp_path / "empty", "--overwrite"])
    assert (tmp_path / "empty/manifest.json").read_bytes() == first


def test_merge_refuses_a_user_file_at_its_output_and_replaces_its_own(tmp_path, base_shard, capsys):
    merge = ["merge", "--inputs", base_shard, "--output-prefix", tmp_path / "m", "--quiet"]
    theirs = tmp_path / "m.json"
    theirs.write_bytes(MINE)
    err = user_error([*merge, "--overwrite"], capsys)
    assert f"{theirs} exists and is not a shard" in err, err
    assert theirs.read_bytes() == MINE and sorted(p.name for p in tmp_path.iterdir()) == ["m.json"]
    theirs.unlink()
    run(merge)
    run([*merge, "--overwrite"])
    assert Path(f"{tmp_path}/m.bin").read_bytes() == Path(f"{base_shard}.bin").read_bytes()
    run(["verify", tmp_path / "m"])


def test_adopt_refuses_replacing_a_json_that_is_not_a_manifest_and_replaces_its_own(tmp_path, base_shard,
                                                                                    tokenizer_dir, capsys):
    prefix = tmp_path / "mega"
    for suffix in (".bin", ".idx"):
        shutil.copyfile(f"{base_shard}{suffix}", f"{prefix}{suffix}")
    theirs = tmp_path / "mega.json"
    theirs.write_bytes(MINE)
    err = user_error(["adopt", prefix, "--tokenizer", tokenizer_dir, "--overwrite", "--quiet"], capsys)
    assert f"PREFIX: {theirs} exists and is not a shard" in err, err
    assert theirs.read_bytes() == MINE
    theirs.write_text(json.dumps(json.loads(Path(f"{base_shard}.json").read_text())))  # a manifest: replaced
    run(["adopt", prefix, "--tokenizer", tokenizer_dir, "--overwrite", "--quiet"])
    assert read_shard_manifest(prefix).created_by == "tessera-data adopt"


def test_a_publish_cut_short_leaves_what_the_next_overwrite_recognises(tmp_path, tokenizer_dir, corpus_texts,
                                                                      monkeypatch):
    """The process dies between a shard's two renames: the .idx is published first, so what is left
    is recognised as a shard and the rerun with --overwrite replaces it (a lone .bin would not be)."""
    import os

    from tessera.data_prep import shard_writer

    class DiesAfterOneRename:
        def __getattr__(self, name):
            return getattr(os, name)

        def replace(self, src, dst):
            os.replace(src, dst)
            raise KeyboardInterrupt

    corpus = _corpus(tmp_path, corpus_texts)
    prep = ["prep", "--input", corpus, "--tokenizer", tokenizer_dir, "--output-prefix", tmp_path / "o/x", "--quiet"]
    with monkeypatch.context() as patched:
        patched.setattr(shard_writer, "os", DiesAfterOneRename())
        with pytest.raises((KeyboardInterrupt, SystemExit)):
            run(prep)
    assert sorted(p.name for p in (tmp_path / "o").iterdir() if not p.name.startswith(".")) == ["x_text_document.idx"]
    run([*prep, "--overwrite"])
    run(["verify", tmp_path / "o/x_text_document"])
