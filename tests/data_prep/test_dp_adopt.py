"""`tessera-data adopt`: a shard built by Megatron-Core's own IndexedDatasetBuilder is checked, given a
manifest, blended with a Tessera shard and trained on.

The Megatron shard is written by megatron-core itself when it is installed (a dev requirement; its
dataset builder runs on CPU), else by the reference writer of test_dp_megatron_format, which follows
the published format and shares no code with Tessera. Documents are sentence-split (several
sequences per document, as preprocess_data.py --split-sentences writes) and end with the
tokenizer's end-of-document id, as --append-eod writes.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import yaml
from dp_helpers import run, user_error
from test_dp_megatron_format import ref_write

from tessera.common.indexed_dataset import IndexedDataset
from tessera.common.mixture import MixtureSplit
from tessera.common.shard import open_shard, read_shard_manifest
from tessera.common.tokenizer import load_tokenizer
from tessera.data_prep.prep import end_of_document_id


def _megatron_documents(tokenizer_dir: Path, texts: list[str]) -> list[list[np.ndarray]]:
    """Each text as sentences (one sequence per line) with the end-of-document id appended."""
    tok = load_tokenizer(tokenizer_dir)
    eod = end_of_document_id(tok)
    docs = []
    for text in texts:
        lines = [line for line in text.splitlines() if line.strip()][:6]
        seqs = [np.asarray(tok.encode(line + "\n"), dtype=np.uint16) for line in lines]
        seqs[-1] = np.append(seqs[-1], np.uint16(eod))
        docs.append(seqs)
    return docs


def _write_with_megatron(prefix: Path, docs: list[list[np.ndarray]]) -> str:
    try:
        import torch
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    except ImportError:
        ref_write(prefix, docs, np.uint16)
        return "reference writer"
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    for seqs in docs:
        builder.add_document(torch.from_numpy(np.concatenate(seqs).astype(np.int64)), [len(s) for s in seqs])
    builder.finalize(f"{prefix}.idx")
    return "megatron-core"


@pytest.fixture
def megatron_shard(tmp_path, tokenizer_dir, corpus_texts) -> Path:
    prefix = tmp_path / "mega" / "megatron_text_sentence"
    prefix.parent.mkdir()
    docs = _megatron_documents(tokenizer_dir, corpus_texts[:30])
    _write_with_megatron(prefix, docs)
    return prefix


def test_a_megatron_built_shard_is_adopted_blended_with_ours_and_trained_on(
        megatron_shard, base_shard, tokenizer_dir, tmp_path, capsys):
    from tessera.trainer.cli import main as train_main

    assert "shard manifest not found; for a shard made by another tool (Megatron), run `tessera-data adopt" in \
        user_error(["blend", "--data", megatron_shard, "--seq-length", 32, "--train-samples", 8,
                    "--output", tmp_path / "m0"], capsys)
    assert run(["adopt", megatron_shard, "--tokenizer", tokenizer_dir, "--quiet"]) == 0
    manifest = read_shard_manifest(megatron_shard)
    eod = end_of_document_id(load_tokenizer(tokenizer_dir))
    assert manifest.append_eod and manifest.eod_id == eod and manifest.block_checksums
    ds = IndexedDataset(megatron_shard)
    assert len(ds) > ds.num_documents  # sentence-split: several sequences per document
    open_shard(megatron_shard, "full")  # every block's checksum and ids check out
    assert run(["verify", megatron_shard]) == 0

    mix = tmp_path / "mix"
    assert run(["blend", "--data", "0.5", megatron_shard, "0.5", base_shard, "--seq-length", "32", "--split",
                "9,1,0", "--train-samples", "64", "--valid-samples", "8", "--output", mix, "--quiet"]) == 0
    split = MixtureSplit(mix, "train")
    assert {int(k) for k in np.unique(np.asarray(split.dataset_index))} == {0, 1}  # both shards sampled
    assert all(len(split[n]) == 33 for n in range(len(split)))

    config = tmp_path / "train.yaml"
    config.write_text(yaml.safe_dump({
        "run_dir": str(tmp_path / "run"),
        "model": {"preset": "tiny", "hidden_size": 32, "ffn_hidden_size": 64, "max_seq_len": 64, "vocab_size": 1024},
        "data": {"mixture": str(mix), "tokenizer": str(tokenizer_dir)},
        "training": {"global_batch_size": 4, "micro_batch_size": 2, "seq_length": 32, "steps": 3,
                     "log_interval": 1, "threads": 1},
        "logging": {"tensorboard": False},
    }))
    assert train_main(["--config", str(config), "--quiet"]) == 0
    losses = [json.loads(line)["loss"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
              if json.loads(line).get("kind", "train") == "train" and "loss" in json.loads(line)]
    assert len(losses) == 3 and all(np.isfinite(losses))


def test_adopted_documents_read_as_megatron_reads_them(megatron_shard, tokenizer_dir):
    pytest.importorskip("megatron.core")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.indexed_dataset import IndexedDataset as MegatronDataset
    assert run(["adopt", megatron_shard, "--tokenizer", tokenizer_dir, "--quiet"]) == 0
    ours, theirs = open_shard(megatron_shard), MegatronDataset(str(megatron_shard))
    assert len(theirs) == len(ours)
    for doc in range(ours.num_documents):
        first, last = int(ours.doc_idx[doc]), int(ours.doc_idx[doc + 1])
        want = np.concatenate([theirs[i] for i in range(first, last)])
        np.testing.assert_array_equal(ours.document_tokens(doc), want)


def test_adopt_refuses_what_it_cannot_trust(megatron_shard, tokenizer_dir, tmp_path, capsys):
    assert "documents do not end with --eod-id 5" in user_error(["adopt", megatron_shard, "--tokenizer", tokenizer_dir, "--eod-id", "5"],
                                         capsys)
    assert not Path(f"{megatron_shard}.json").exists()
    assert run(["adopt", megatron_shard, "--tokenizer", tokenizer_dir, "--quiet"]) == 0
    assert "already has a manifest" in user_error(["adopt", megatron_shard, "--tokenizer", tokenizer_dir], capsys)
    # A shard whose ids exceed the tokenizer's vocabulary (made with another tokenizer).
    bad = tmp_path / "bad"
    ref_write(bad, [[np.array([1, 2, 3000], dtype=np.uint16)]], np.uint16)
    err = user_error(["adopt", bad, "--tokenizer", tokenizer_dir], capsys)
    assert "bad.bin: token 2 has id 3000, outside the tokenizer's vocabulary [0, 1024)" in err
    assert not Path(f"{bad}.json").exists()
    # A malformed index is refused by the structural check.
    ref_write(tmp_path / "short", [[np.array([1, 2, 3], dtype=np.uint16)]], np.uint16)
    Path(f"{tmp_path / 'short'}.bin").write_bytes(b"\x01\x00")
    assert "short.bin" in user_error(["adopt", tmp_path / "short", "--tokenizer", tokenizer_dir], capsys)
