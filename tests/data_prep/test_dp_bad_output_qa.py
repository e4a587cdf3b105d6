"""Adversarial QA: outputs that cannot be written, and non-YAML configs, are one-line exit-2 errors
decided before any work (they were tracebacks, and --skipped-log DIR failed after publishing shards)."""

from __future__ import annotations

from dp_helpers import run, user_error, write_jsonl

from tessera.common.shard import read_shard_manifest


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


def test_prep_skipped_log_or_tokenizer_output_over_an_input_is_refused_and_the_input_kept(tmp_path, tokenizer_dir,
                                                                                          capsys):
    """--skipped-log corpus.jsonl replaced the corpus by the log of its bad records, and
    --tokenizer-output DIR --overwrite deleted the corpus in DIR; both now name the input."""
    data = tmp_path / "data"
    data.mkdir()
    corpus = write_jsonl(data / "c.jsonl", [{"text": "hello world"}], raw_lines={0: b"{not json"})
    before = corpus.read_bytes()
    err = user_error(["prep", "--input", corpus, "--tokenizer", tokenizer_dir, "--output-prefix", tmp_path / "o/x",
                      "--skipped-log", corpus, "--quiet"], capsys)
    assert f"--skipped-log {corpus}: holds the input {corpus}" in err, err
    err = user_error(["prep", "--input", data, "--train-tokenizer", "--vocab-size", 300, "--tokenizer-output", data,
                      "--output-prefix", tmp_path / "o/y", "--overwrite", "--quiet"], capsys)
    assert f"--tokenizer-output {data}: holds the input {corpus}" in err, err
    assert corpus.read_bytes() == before and sorted(p.name for p in data.iterdir()) == ["c.jsonl"]
    assert not (tmp_path / "o").exists() or not any((tmp_path / "o").iterdir())


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


def test_prep_deeply_nested_json_record_is_a_bad_record_not_a_traceback(tmp_path, tokenizer_dir, capsys):
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"text": "hello world"}, {"text": "after"}],
                         raw_lines={1: b'{"text": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"})
    err = user_error(["prep", "--input", corpus, "--tokenizer", tokenizer_dir, "--output-prefix", tmp_path / "o/x",
                      "--on-error", "fail", "--quiet"], capsys)
    assert "c.jsonl:2" in err and "nested too deeply" in err
    assert not list((tmp_path / "o").glob("x*.bin"))
    assert run(["prep", "--input", corpus, "--tokenizer", tokenizer_dir, "--output-prefix", tmp_path / "s/x",
                "--on-error", "skip", "--quiet"]) == 0
    assert read_shard_manifest(tmp_path / "s" / "x_text_document").num_documents == 2


def test_prep_corrupt_gzip_is_one_line_in_both_error_modes(tmp_path, tokenizer_dir, capsys):
    import gzip

    data = bytearray(gzip.compress(b"".join(b'{"text": "doc %d xyz"}\n' % i for i in range(20_000))))
    data[len(data) // 2] ^= 0xFF
    data[len(data) // 2 + 1] ^= 0xFF
    corpus = tmp_path / "c.jsonl.gz"
    corpus.write_bytes(bytes(data))
    for mode in ("fail", "skip"):
        err = user_error(["prep", "--input", corpus, "--tokenizer", tokenizer_dir,
                          "--output-prefix", tmp_path / mode / "x", "--on-error", mode, "--quiet"], capsys)
        assert "c.jsonl.gz" in err and "corrupt or truncated" in err
        assert not list((tmp_path / mode).glob("x*.bin"))
