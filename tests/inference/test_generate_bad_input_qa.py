"""Adversarial QA of tessera-generate's input checks (in process: all fail before the model loads).
Each case was a traceback (exit 1), or, for --output equal to --prompts, overwrote the prompts."""

from __future__ import annotations

import pytest
from inference_helpers import generate_usage_error as _usage_error


@pytest.mark.parametrize("content, expected", [
    (b'{"prompt": "a\\udc80b", "max_tokens": 2}\n', ":1: holds a lone surrogate"),
    (b'{"messages": [{"role": "user", "content": "\\ud800"}]}\n', ":1: holds a lone surrogate"),
    (b'{"prompt": "ok"}\n\xff\xfe\x00\x01garbage\n', "not UTF-8 text"),
])
def test_bad_prompts_file(tmp_path, capsys, content, expected):
    prompts = tmp_path / "p.jsonl"
    prompts.write_bytes(content)
    err = _usage_error(["--checkpoint", tmp_path, "--prompts", prompts, "--output", tmp_path / "o.jsonl"], capsys)
    assert str(prompts) in err and expected in err


def test_bad_output_path(tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    err = _usage_error(["--checkpoint", tmp_path, "--prompts", prompts, "--output", prompts], capsys)
    assert "--output is the --prompts file" in err
    assert prompts.read_text() == '{"prompt": "hi"}\n'
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    err = _usage_error(["--checkpoint", tmp_path, "--prompts", prompts, "--output", blocker / "o.jsonl"], capsys)
    assert "cannot create the output folder" in err


def test_an_output_that_is_a_file_of_the_checkpoint_is_refused_and_the_file_kept(tmp_path, capsys):
    """--output <hf dir>/config.json used to replace the model's config by the completions (exit 0)."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    model = tmp_path / "hf"
    model.mkdir()
    (model / "config.json").write_text("{}")
    err = _usage_error(["--checkpoint", model, "--prompts", prompts, "--output", model / "config.json"], capsys)
    assert f"--output is a file of the --checkpoint {model}" in err, err
    assert (model / "config.json").read_text() == "{}"
    # A hub snapshot: its files are links to blobs outside it (the write would replace the link).
    blob = tmp_path / "blobs" / "cfg"
    blob.parent.mkdir()
    blob.write_text("{}")
    (model / "tokenizer_config.json").symlink_to(blob)
    err = _usage_error(["--checkpoint", model, "--prompts", prompts, "--output", model / "tokenizer_config.json"],
                       capsys)
    assert "--output is a file of the --checkpoint" in err, err
    assert (model / "tokenizer_config.json").is_symlink() and blob.read_text() == "{}"


def test_more_torch_threads_than_the_process_may_use_is_refused(tmp_path, capsys):
    """--torch-threads 100000 made torch start 10^5 threads and segfault (exit 139); one more than
    the CPUs shows the refusal without that risk."""
    import os

    import torch

    cpus = len(os.sched_getaffinity(0))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    before = torch.get_num_threads()
    try:
        err = _usage_error(["--checkpoint", tmp_path, "--prompts", prompts, "--output", tmp_path / "o.jsonl",
                            "--torch-threads", cpus + 1], capsys)
    finally:
        torch.set_num_threads(before)
    assert f"--torch-threads {cpus + 1}: more than the {cpus} CPUs this process may use" in err, err


@pytest.mark.parametrize("flag, value", [("--num-kv-blocks", 10**11), ("--kv-cache-tokens", 10**12),
                                         ("--kv-cache-memory", 10**15)])
def test_a_kv_cache_larger_than_memory_is_refused_before_it_is_allocated(tiny_ckpt, tmp_path, capsys, flag, value):
    """Each was a MemoryError traceback from the block manager's lists or the pool's allocation
    (exit 1): now one line naming the flag, the pool's size and the memory, before anything is allocated."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    err = _usage_error(["--checkpoint", tiny_ckpt, "--prompts", prompts, "--output", tmp_path / "o.jsonl",
                        flag, value], capsys)
    assert f"error: {flag} {value}: a KV cache of " in err and "GiB of this machine's memory; lower it" in err, err
    assert not (tmp_path / "o.jsonl").exists()
