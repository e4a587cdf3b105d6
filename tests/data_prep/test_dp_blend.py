"""`tessera-data blend`: samples against a slow reference, weights at every prefix, epochs, determinism."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from dp_helpers import run, user_error, write_jsonl

from tessera.common.indexed_dataset import IndexedDataset
from tessera.common.mixture import MixtureSplit, read_mixture_manifest
from tessera.data_prep.blend import blend_assignment, split_ranges
from tessera.data_prep.tokenizer_train import save_tokenizer, train_bpe

SEQ = 32


@pytest.fixture(scope="module")
def shards(tmp_path_factory, tokenizer_dir, base_shard, corpus_texts) -> tuple[Path, Path]:
    """A big shard (stdlib modules) and a small one that must be repeated for several epochs."""
    d = tmp_path_factory.mktemp("blend")
    small = write_jsonl(d / "small.jsonl", [{"text": t[:300]} for t in corpus_texts[:12]])
    run(["prep", "--input", small, "--tokenizer", tokenizer_dir, "--output-prefix", d / "small", "--quiet"])
    return base_shard, d / "small_text_document"


def _blend(out: Path, a: Path, b: Path, *extra) -> Path:
    run(["blend", "--data", 0.7, a, 0.3, b, "--seq-length", SEQ, "--split", "80,20,0", "--train-samples", 600,
         "--valid-samples", 40, "--seed", 7, "--output", out, "--quiet", *extra])
    return out


@pytest.fixture(scope="module")
def mixture(tmp_path_factory, shards) -> Path:
    return _blend(tmp_path_factory.mktemp("mix") / "mix", *shards)


def _reference_samples(ds: IndexedDataset, doc_index: np.ndarray, num_samples: int) -> list[np.ndarray]:
    """Slow reconstruction: concatenate documents in stored order; sample i = tokens [i*L, i*L + L]."""
    stream = np.concatenate([np.asarray(ds.document_tokens(int(d)), dtype=np.int64) for d in doc_index])
    return [stream[i * SEQ: i * SEQ + SEQ + 1] for i in range(num_samples)]


@pytest.mark.parametrize("split", ["train", "valid"])
def test_samples_equal_slow_reference(mixture, split):
    ms = MixtureSplit(mixture, split)
    m = read_mixture_manifest(mixture)
    assert len(ms) == m.splits[split].num_samples
    counts = [0, 0]
    refs = []
    for k, (first, last) in enumerate(m.splits[split].documents):
        doc_index = np.asarray(ms.document_index[k])
        n_docs = last - first
        epochs = len(doc_index) // n_docs
        assert len(doc_index) == epochs * n_docs
        for e in range(epochs):  # every epoch is a permutation of exactly this split's documents
            assert sorted(doc_index[e * n_docs:(e + 1) * n_docs].tolist()) == list(range(first, last))
        n_k = int((np.asarray(ms.dataset_index) == k).sum())
        assert sorted(np.asarray(ms.shuffle_index[k]).tolist()) == list(range(n_k))
        refs.append(_reference_samples(ms.datasets[k], doc_index, n_k))
    for n in range(len(ms)):
        k = int(ms.dataset_index[n])
        assert int(ms.dataset_sample_index[n]) == counts[k]
        sample = ms[n]
        assert sample.shape == (SEQ + 1,)
        np.testing.assert_array_equal(sample, refs[k][int(ms.shuffle_index[k][counts[k]])])
        counts[k] += 1


def test_split_ranges_are_disjoint_and_megatron_rounded(mixture, shards):
    m = read_mixture_manifest(mixture)
    for k, shard in enumerate(shards):
        n = IndexedDataset(shard).num_documents
        train, valid = m.splits["train"].documents[k], m.splits["valid"].documents[k]
        assert train[0] == 0 and train[1] == valid[0] and valid[1] == n
    assert split_ranges([0.969, 0.03, 0.001], 1000) == [(0, 969), (969, 999), (999, 1000)]


def test_weights_hold_at_every_prefix():
    rng = np.random.default_rng(0)
    for _ in range(5):
        w = rng.random(4)
        w /= w.sum()
        idx, sample_idx, counts = blend_assignment(list(w), 5000)
        onehot = np.zeros((5000, 4))
        onehot[np.arange(5000), idx] = 1
        prefix_counts = np.cumsum(onehot, axis=0)  # counts after n+1 samples
        n = np.arange(1, 5001)[:, None]
        assert np.abs(prefix_counts - w[None, :] * n).max() <= 1.0
        assert counts == prefix_counts[-1].astype(int).tolist()


def test_mixture_honours_weights_at_every_prefix(mixture):
    ms = MixtureSplit(mixture, "train")
    w = [d.weight for d in read_mixture_manifest(mixture).datasets]
    assert w == pytest.approx([0.7, 0.3])
    c = np.cumsum(np.asarray(ms.dataset_index) == 1)
    assert np.abs(c - 0.3 * np.arange(1, len(ms) + 1)).max() <= 1.0


def test_exhausted_dataset_starts_a_new_epoch_with_a_fresh_shuffle(mixture):
    ms = MixtureSplit(mixture, "train")
    first, last = read_mixture_manifest(mixture).splits["train"].documents[1]
    n_docs = last - first
    doc_index = np.asarray(ms.document_index[1])
    epochs = [doc_index[e * n_docs:(e + 1) * n_docs].tolist() for e in range(len(doc_index) // n_docs)]
    assert len(epochs) >= 3  # the small shard ran out more than once
    assert len({tuple(e) for e in epochs}) == len(epochs)  # each epoch is shuffled afresh


def test_rebuild_is_byte_identical_and_yaml_equals_flags(tmp_path, mixture, shards):
    again = _blend(tmp_path / "again", *shards)
    a_files = sorted(p.relative_to(mixture) for p in mixture.rglob("*") if p.is_file())
    b_files = sorted(p.relative_to(again) for p in again.rglob("*") if p.is_file())
    assert a_files == b_files and len(a_files) == 1 + 2 * (2 + 3 * 2)
    for rel in a_files:
        if rel.name != "manifest.json":  # the manifest holds prefixes relative to its own directory
            assert (mixture / rel).read_bytes() == (again / rel).read_bytes(), rel
    a, b = shards
    (tmp_path / "blend.yaml").write_text(
        f"data:\n  - {{prefix: {a}, weight: 0.7}}\n  - {{prefix: {b}, weight: 0.3}}\nseq_length: {SEQ}\n"
        "split: '80,20,0'\ntrain_samples: 600\nvalid_samples: 40\nseed: 7\n")
    run(["blend", "--config", tmp_path / "blend.yaml", "--output", tmp_path / "from_yaml", "--quiet"])
    assert (tmp_path / "from_yaml/manifest.json").read_bytes() == (again / "manifest.json").read_bytes()
    changed = _blend(tmp_path / "seed8", *shards, "--seed", 8)
    assert (changed / "train/d0_shuffle_index.npy").read_bytes() != (again / "train/d0_shuffle_index.npy").read_bytes()


def test_blend_refuses_bad_requests(tmp_path, shards, corpus_texts, capsys):
    a, b = shards
    base = ["--seq-length", SEQ, "--train-samples", 10, "--output", tmp_path / "m"]
    assert "nope.json: shard manifest not found" in user_error(["blend", "--data", tmp_path / "nope", *base], capsys)
    assert "split" in user_error(["blend", "--data", a, "--split", "9,x,1", *base], capsys)
    assert "train_samples" in user_error(["blend", "--data", a, "--seq-length", SEQ, "--train-samples", 0,
                                           "--output", tmp_path / "m"], capsys)
    err = user_error(["blend", "--data", a, "--seq-length", SEQ, "--train-samples", 10**14,
                      "--output", tmp_path / "m"], capsys)
    assert "--train/valid/test-samples" in err and "GiB of index" in err and "request fewer samples" in err
    assert "no tokens in the valid split" in user_error(
        ["blend", "--data", a, "--split", "100,0,0", "--valid-samples", 5, *base], capsys)
    assert "WEIGHT PREFIX" in user_error(["blend", "--data", 0.5, a, b, *base], capsys)
    other = tmp_path / "tok2"
    save_tokenizer(train_bpe(corpus_texts[:3], 300), other, 512)
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"text": t} for t in corpus_texts[:3]])
    run(["prep", "--input", corpus, "--tokenizer", other, "--output-prefix", tmp_path / "o", "--quiet"])
    err = user_error(["blend", "--data", 0.5, a, 0.5, tmp_path / "o_text_document", *base], capsys)
    assert "o_text_document.json" in err and "share a tokenizer" in err
    assert not (tmp_path / "m").exists()


def test_a_bad_flag_is_reported_against_the_flag_not_the_yaml_file(tmp_path, shards, capsys):
    config = tmp_path / "blend.yaml"
    config.write_text(f"data: [{{prefix: {shards[0]}, weight: 1.0}}]\nseq_length: {SEQ}\ntrain_samples: 10\n"
                      f"output: {tmp_path / 'm'}\n")
    err = user_error(["blend", "--config", config, "--seq-length", 0], capsys)
    assert "--seq-length 0: invalid config: seq_length" in err and "blend.yaml" not in err, err
    config.write_text(config.read_text().replace("train_samples: 10", "train_samples: -1"))
    assert f"{config}: invalid config: train_samples" in user_error(["blend", "--config", config], capsys)
    # A `data:` list of weights and prefixes in the file is named as the file's, not as --data.
    config.write_text(f"data: [0.5, {shards[0]}, {shards[1]}]\nseq_length: {SEQ}\ntrain_samples: 10\n"
                      f"output: {tmp_path / 'm'}\n")
    err = user_error(["blend", "--config", config], capsys)
    assert f"error: {config}: data: expected WEIGHT PREFIX pairs" in err and "--data" not in err, err
    assert not (tmp_path / "m").exists()


def test_blend_over_the_folder_of_its_shards_is_refused_even_with_overwrite(tmp_path, base_shard, capsys):
    """--overwrite replaced the folder holding the input shards by the mixture, which then pointed at
    shards it had deleted; now one line names the shard and nothing is touched."""
    import shutil

    folder = tmp_path / "data"
    folder.mkdir()
    for suffix in (".bin", ".idx", ".json"):
        shutil.copy(f"{base_shard}{suffix}", folder / f"a{suffix}")
    before = sorted(p.name for p in folder.iterdir())
    err = user_error(["blend", "--data", folder / "a", "--seq-length", SEQ, "--train-samples", 4, "--output", folder,
                      "--overwrite", "--quiet"], capsys)
    assert f"--output {folder}: holds the input {folder / 'a.bin'}" in err, err
    assert sorted(p.name for p in folder.iterdir()) == before


def test_a_seq_length_whose_document_order_outgrows_memory_is_refused_before_building(tmp_path, shards, capsys,
                                                                                      monkeypatch):
    """--seq-length 10^12 over a small shard repeats its documents once per epoch, 10^9 entries: blend
    was killed for memory after minutes. The machine is made to report 1 MiB so that the same refusal
    shows on an index of a few MiB (without the check this blend succeeds)."""
    from tessera.data_prep import blend

    monkeypatch.setattr(blend, "physical_memory", lambda: 2**20)
    seq = 2000 * int(blend.document_lengths(IndexedDataset(str(shards[0]))).sum()) // 10  # ~2000 epochs: > 1 MiB
    err = user_error(["blend", "--data", shards[0], "--seq-length", seq, "--split", "1", "--train-samples", 10,
                      "--output", tmp_path / "m"], capsys)
    assert f"--seq-length {seq}: 10 train samples read the" in err and "more than the 0.0 GiB of memory" in err, err
    assert "a shorter --seq-length" in err and not (tmp_path / "m").exists()
