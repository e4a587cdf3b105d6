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
    (tmp_path / "tok" / "todo.txt").write_text("keep me")  # a tokenizer and a user's file: not replaced whole
    err = user_error([*train, "--tokenizer-output", tmp_path / "tok", "--overwrite"], capsys)
    assert f"--tokenizer-output {tmp_path / 'tok'}: holds 4 files or folders that are not a tokenizer folder" in err, err
    assert (tmp_path / "tok" / "todo.txt").read_text() == "keep me"
    (tmp_path / "tok" / "todo.txt").unlink()
    run([*train, "--tokenizer-output", tmp_path / "tok", "--overwrite"])
    assert (tmp_path / "tok" / "tokenizer.json").is_file()


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
    (tmp_path / "mix/a.txt").write_bytes(MINE)  # a mixture and a user's file: not replaced whole
    err = user_error([*blend, "--output", tmp_path / "mix", "--overwrite"], capsys)
    assert f"--output {tmp_path / 'mix'}: holds " in err and "not a mixture directory" in err, err
    assert (tmp_path / "mix/a.txt").read_bytes() == MINE
    (tmp_path / "mix/a.txt").unlink()
    run([*blend, "--output", tmp_path / "mix", "--overwrite"])
    assert (tmp_path / "mix/manifest.json").read_bytes() == first
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


def test_a_publish_cut_short_between_its_renames_leaves_no_index_and_its_lone_bin_is_refused(
        tmp_path, tokenizer_dir, corpus_texts, monkeypatch, capsys):
    """The process dies between a shard's two renames: the .bin is published first, so no reader
    meets an index without its data; the lone .bin left could be anyone's, so --overwrite names it
    rather than deleting it, and once it is removed the rerun writes the shard."""
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
    lone = tmp_path / "o/x_text_document.bin"
    assert sorted(p.name for p in (tmp_path / "o").iterdir() if not p.name.startswith(".")) == [lone.name]
    kept = lone.read_bytes()
    err = user_error([*prep, "--overwrite"], capsys)
    assert f"{lone} exists and is not a shard" in err and lone.read_bytes() == kept, err
    lone.unlink()
    run(prep)
    run(["verify", tmp_path / "o/x_text_document"])


def _watch_final_names(monkeypatch, directory: Path) -> list[str]:
    """After every rename and removal while a writer publishes: each .idx under a final name in
    `directory` must open with the .bin beside it (IndexedDataset checks the .bin is there and of
    the size the index says), i.e. a reader never meets an index without its data."""
    import os

    from tessera.common.indexed_dataset import IndexedDataset

    seen: list[str] = []
    real_replace, real_unlink = os.replace, Path.unlink

    def check(what: str) -> None:
        for idx in directory.glob("*.idx"):
            if not idx.name.startswith("."):  # staging names: no reader opens them
                IndexedDataset(idx.with_suffix(""))
        seen.append(what)

    def replace(src, dst):
        real_replace(src, dst)
        check(f"replace {Path(dst).name}")

    def unlink(self, missing_ok=False):
        real_unlink(self, missing_ok=missing_ok)
        check(f"unlink {self.name}")

    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(Path, "unlink", unlink)
    return seen


def test_prep_overwriting_its_shards_never_shows_an_idx_without_its_bin(tmp_path, tokenizer_dir, corpus_texts,
                                                                       monkeypatch):
    corpus = _corpus(tmp_path, corpus_texts)
    prep = ["prep", "--input", corpus, "--tokenizer", tokenizer_dir, "--output-prefix", tmp_path / "o/x", "--quiet"]
    run(prep)
    write_jsonl(corpus, [{"text": t} for t in corpus_texts[6:9]])  # another size: an old .bin would not fit
    with monkeypatch.context() as patched:
        seen = _watch_final_names(patched, tmp_path / "o")
        run([*prep, "--overwrite"])
    assert "unlink x_text_document.bin" in seen and "replace x_text_document.idx" in seen, seen
    run(["verify", tmp_path / "o/x_text_document"])


def test_merge_overwriting_its_output_never_shows_an_idx_without_its_bin(tmp_path, base_shard, monkeypatch):
    run(["merge", "--inputs", base_shard, "--output-prefix", tmp_path / "m", "--quiet"])
    with monkeypatch.context() as patched:
        seen = _watch_final_names(patched, tmp_path)
        run(["merge", "--inputs", base_shard, base_shard, "--output-prefix", tmp_path / "m", "--overwrite", "--quiet"])
    assert "replace m.idx" in seen and "replace m.bin" in seen, seen
    run(["verify", tmp_path / "m"])


def test_converting_a_tokenizer_file_over_an_earlier_tokenizer_replaces_it_whole(tmp_path, tokenizer_dir,
                                                                                corpus_texts):
    """`prep --tokenizer vocab.txt --tokenizer-output tok --overwrite` over a tokenizer folder that
    had a chat template: the converted tokenizer must not inherit the earlier one's files (its
    chat_template.jinja would be read as the new tokenizer's template)."""
    from tessera.common.tokenizer import load_tokenizer

    tok = tmp_path / "tok"
    shutil.copytree(tokenizer_dir, tok)
    (tok / "chat_template.jinja").write_text("{{ messages }}")
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "a", "##s"]) + "\n")
    run(["prep", "--input", _corpus(tmp_path, corpus_texts), "--tokenizer", vocab, "--tokenizer-output", tok,
         "--no-append-eod", "--output-prefix", tmp_path / "o/x", "--overwrite", "--quiet"])
    assert sorted(p.name for p in tok.iterdir()) == ["tokenizer.json", "tokenizer_config.json", "vocab.txt"]
    assert load_tokenizer(tok).chat_template is None
