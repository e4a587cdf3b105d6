"""Megatron MMIDIDX v1 compatibility, both directions, against a reference written from the format text.

The reference writer and reader below use only struct and numpy and follow the published layout
(magic, u64 version, u8 dtype code, u64 sequence count, u64 document count + 1, int32 lengths,
int64 byte pointers, int64 document indices; tokens back to back in `.bin`). They share no code
with tessera.common.indexed_dataset.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

from tessera.common.errors import ArtifactError
from tessera.common.indexed_dataset import IndexedDataset, IndexedDatasetWriter, write_index

REF_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16}


def ref_write(prefix: Path, documents: list[list[np.ndarray]], dtype) -> None:
    """Megatron-style builder: each document is a list of sequences (sentences)."""
    code = {np.dtype(v): k for k, v in REF_CODES.items()}[np.dtype(dtype)]
    lengths, doc_idx = [], [0]
    with open(f"{prefix}.bin", "wb") as f:
        for doc in documents:
            for seq in doc:
                f.write(np.asarray(seq, dtype=dtype).tobytes())
                lengths.append(len(seq))
            doc_idx.append(len(lengths))
    pointers, pos = [], 0
    for n in lengths:
        pointers.append(pos)
        pos += n * np.dtype(dtype).itemsize
    with open(f"{prefix}.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00")
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", code))
        f.write(struct.pack("<Q", len(lengths)))
        f.write(struct.pack("<Q", len(doc_idx)))
        f.write(struct.pack(f"<{len(lengths)}i", *lengths))
        f.write(struct.pack(f"<{len(pointers)}q", *pointers))
        f.write(struct.pack(f"<{len(doc_idx)}q", *doc_idx))


def ref_read(prefix: Path) -> tuple[np.dtype, list[np.ndarray], list[int]]:
    """Returns (dtype, sequences, document indices)."""
    data = Path(f"{prefix}.idx").read_bytes()
    assert data[:9] == b"MMIDIDX\x00\x00"
    (version,) = struct.unpack_from("<Q", data, 9)
    assert version == 1
    dtype = np.dtype(REF_CODES[data[17]])
    s, d1 = struct.unpack_from("<QQ", data, 18)
    off = 34
    lengths = struct.unpack_from(f"<{s}i", data, off)
    off += 4 * s
    pointers = struct.unpack_from(f"<{s}q", data, off)
    off += 8 * s
    doc_idx = list(struct.unpack_from(f"<{d1}q", data, off))
    assert off + 8 * d1 == len(data)
    raw = Path(f"{prefix}.bin").read_bytes()
    seqs = [np.frombuffer(raw, dtype=dtype, count=n, offset=p) for n, p in zip(lengths, pointers)]
    return dtype, seqs, doc_idx


def _random_docs(rng, n_docs, max_len, vocab, max_seqs=1, dtype=np.uint16):
    return [[rng.integers(0, vocab, rng.integers(0 if max_seqs > 1 else 1, max_len)).astype(dtype)
             for _ in range(rng.integers(1, max_seqs + 1))] for _ in range(n_docs)]


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_megatron_written_shard_reads_back_through_tessera(tmp_path, dtype):
    rng = np.random.default_rng(0)
    docs = _random_docs(rng, 50, 40, 60000 if dtype == np.uint16 else 200000, dtype=dtype)
    ref_write(tmp_path / "m", docs, dtype)
    ds = IndexedDataset(tmp_path / "m")
    assert ds.dtype == np.dtype(dtype) and ds.num_documents == 50 and len(ds) == 50
    for i, doc in enumerate(docs):
        np.testing.assert_array_equal(ds.document_tokens(i), doc[0])
        np.testing.assert_array_equal(ds[i], doc[0])


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_tessera_written_shard_reads_back_through_reference(tmp_path, dtype):
    rng = np.random.default_rng(1)
    docs = [d[0] for d in _random_docs(rng, 40, 30, 1000, dtype=dtype)]
    with IndexedDatasetWriter(tmp_path / "t", dtype) as w:
        w.add_document(docs[0])
        w.add_raw(np.concatenate(docs[1:]).tobytes(), np.array([len(d) for d in docs[1:]]))
    rdtype, seqs, doc_idx = ref_read(tmp_path / "t")
    assert rdtype == np.dtype(dtype)
    assert doc_idx == list(range(41))
    for got, want in zip(seqs, docs):
        np.testing.assert_array_equal(got, want)
    # Byte for byte what the reference builder writes for the same documents.
    ref_write(tmp_path / "r", [[d] for d in docs], dtype)
    assert Path(tmp_path / "t.idx").read_bytes() == Path(tmp_path / "r.idx").read_bytes()
    assert Path(tmp_path / "t.bin").read_bytes() == Path(tmp_path / "r.bin").read_bytes()


def test_multi_sequence_documents(tmp_path):
    """Megatron sentence-split data: a document spans several sequences (some empty)."""
    rng = np.random.default_rng(2)
    docs = _random_docs(rng, 30, 12, 500, max_seqs=4)
    ref_write(tmp_path / "s", docs, np.uint16)
    ds = IndexedDataset(tmp_path / "s")
    assert ds.num_documents == 30 and len(ds) == sum(len(d) for d in docs)
    for i, doc in enumerate(docs):
        np.testing.assert_array_equal(ds.document_tokens(i), np.concatenate(doc))
    flat = [s for d in docs for s in d]
    for j, seq in enumerate(flat):
        np.testing.assert_array_equal(ds[j], seq)


def test_chunked_index_writer_matches_in_memory(tmp_path, monkeypatch):
    """The streaming index (spilled lengths, chunked pointers) equals the one-shot index."""
    import tessera.common.indexed_dataset as idx

    monkeypatch.setattr(idx, "_CHUNK", 7)  # force many chunks, with a carried running offset
    rng = np.random.default_rng(3)
    lengths = rng.integers(0, 20, 50)
    with IndexedDatasetWriter(tmp_path / "a", np.int32) as w:
        for n in lengths:
            w.add_document(rng.integers(0, 100, n))
    write_index(tmp_path / "b.idx", np.dtype(np.int32), lengths.astype(np.int32), np.arange(51))
    assert (tmp_path / "a.idx").read_bytes() == (tmp_path / "b.idx").read_bytes()
    assert not list(tmp_path.glob(".*"))  # no temporary files left behind


def test_reader_rejects_truncated_index(tmp_path):
    ref_write(tmp_path / "x", [[np.arange(5, dtype=np.uint16)]], np.uint16)
    data = (tmp_path / "x.idx").read_bytes()
    (tmp_path / "x.idx").write_bytes(data[:-3])
    with pytest.raises(ArtifactError, match="x.idx"):
        IndexedDataset(tmp_path / "x")
