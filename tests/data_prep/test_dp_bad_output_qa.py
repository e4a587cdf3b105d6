"""Adversarial QA: outputs that cannot be written, and non-YAML configs, are one-line exit-2 errors
decided before any work (they were tracebacks, and --skipped-log DIR failed after publishing shards)."""

from __future__ import annotations

from dp_helpers import user_error, write_jsonl


def test_prep_output_folder_that_cannot_be_created(tmp_path, tokenizer_dir, capsys):
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"text": "hello world"}])
    blocker = tmp_path / "file"
    blocker.write_text("x")
    err = user_error(["prep", "--input", corpus, "--tokenizer", tokenizer_dir,
                      "--output-prefix", blocker / "sub/out", "--quiet"], capsys)
    assert "--output-prefix" in err and "cannot create the output folder" in err


def test_prep_skipped_log_that_is_a_folder_is_refused_before_any_output(tmp_path, tokenizer_dir, capsys):
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"text": "hello world"}])
    (tmp_path / "logdir").mkdir()
    err = user_error(["prep", "--input", corpus, "--tokenizer", tokenizer_dir, "--output-prefix", tmp_path / "o/x",
                      "--skipped-log", tmp_path / "logdir", "--quiet"], capsys)
    assert "--skipped-log" in err and "folder" in err
    assert not (tmp_path / "o").exists()


def test_blend_output_problems(tmp_path, base_shard, capsys):
    common = ["blend", "--data", base_shard, "--seq-length", 16, "--train-samples", 2, "--quiet"]
    victim = tmp_path / "notes.txt"
    victim.write_text("keep me")
    err = user_error([*common, "--output", victim, "--overwrite"], capsys)
    assert "not a mixture directory" in err
    assert victim.read_text() == "keep me" and sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
    err = user_error([*common, "--output", victim / "mix"], capsys)
    assert "cannot create the output folder" in err


def test_blend_config_not_utf8(tmp_path, capsys):
    cfg = tmp_path / "blend.yaml"
    cfg.write_bytes(b"seq_length: 8\n\xff\xfe\x00garbage")
    err = user_error(["blend", "--config", cfg], capsys)
    assert str(cfg) in err and "UTF-8" in err


def test_merge_output_folder_that_cannot_be_created(tmp_path, base_shard, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    err = user_error(["merge", "--inputs", base_shard, "--output-prefix", blocker / "m"], capsys)
    assert "cannot create the output folder" in err


def test_inspect_negative_counts(base_shard, capsys):
    assert "--top -1: must be 0 or more" in user_error(["inspect", base_shard, "--top", -1], capsys)
    assert "--max-chars -5" in user_error(["inspect", base_shard, "--max-chars", -5], capsys)
