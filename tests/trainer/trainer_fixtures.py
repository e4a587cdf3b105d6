"""Tiny real artifacts for trainer tests: a BPE tokenizer, one shard, and a mixture.

Text is the Python standard library's own source (present everywhere); the tokenizer is trained
with `tokenizers`; the shard is written with the common MMIDIDX writer and manifest format; the
mixture files follow the documented layout (tessera.common.mixture) with Megatron's sample-index
semantics. Nothing is downloaded.
"""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import numpy as np
import torch

from tessera.common.fileio import sha256_file
from tessera.common.indexed_dataset import IndexedDatasetWriter, token_dtype_for_vocab
from tessera.common.mixture import MIXTURE_FORMAT, MIXTURE_FORMAT_VERSION, dataset_file, split_file
from tessera.common.shard import SHARD_FORMAT, SHARD_FORMAT_VERSION, shard_fingerprint
from tessera.common.tokenizer import load_tokenizer

# Weights after optimizer steps of two computations that should agree (accumulated micro-batches vs
# one batch, a compiled or chunked loss vs the plain one, torchrun vs one process) are compared
# normwise, with the criterion of tests/parallel/test_parity.py (assert_weights): the model as a
# whole to WEIGHT_RTOL, each tensor to 10x that. Elementwise bounds test float32 rounding instead:
# Adam divides by sqrt(v) + eps, so an element whose gradient nearly cancels turns an ulp of
# difference in summation order into a visible one, and those tests failed on a loaded machine.
WEIGHT_RTOL = 1e-5


def assert_weights_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str = "weights",
                         rtol: float = WEIGHT_RTOL) -> float:
    """Normwise relative error of `got` against `want` (same names), per tensor and model-wide; returns
    the model-wide error."""
    assert set(got) == set(want), f"{what}: names differ: {set(got) ^ set(want)}"
    diff_sq = ref_sq = 0.0
    for name, ref in want.items():
        assert got[name].shape == ref.shape, f"{what}: {name}: shape {tuple(got[name].shape)} vs {tuple(ref.shape)}"
        diff, ref = (got[name] - ref).double(), ref.double()
        err = (diff.norm() / ref.norm()).item()
        assert err <= 10 * rtol, f"{what}: {name}: relative error {err:.2e} > {10 * rtol:g}"
        diff_sq += diff.pow(2).sum().item()
        ref_sq += ref.pow(2).sum().item()
    total = (diff_sq / ref_sq) ** 0.5
    assert total <= rtol, f"{what}: model-wide relative weight error {total:.2e} > {rtol:g}"
    return total


STDLIB_FILES = ("json/decoder.py", "json/encoder.py", "textwrap.py", "shlex.py", "fnmatch.py",
                "glob.py", "colorsys.py", "bisect.py", "heapq.py", "copy.py", "string.py", "abc.py")


def stdlib_documents(max_docs: int = len(STDLIB_FILES)) -> list[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return [(root / name).read_text(encoding="utf-8") for name in STDLIB_FILES[:max_docs]]


def stdlib_lines(max_docs: int = 2000) -> list[str]:
    """Short documents (a few to a few dozen tokens): the non-blank lines of the stdlib files."""
    lines = [line for text in stdlib_documents() for line in text.splitlines() if line.strip()]
    return lines[:max_docs]


def train_tokenizer(out_dir: Path, texts: list[str], vocab_size: int = 384) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|endoftext|>", "bos_token": "<|endoftext|>", "model_max_length": 4096}))
    return out_dir


def write_shard(prefix: Path, docs: list[list[int]], tokenizer_dir: Path, vocab_size: int) -> None:
    dtype = token_dtype_for_vocab(vocab_size)
    with IndexedDatasetWriter(prefix, dtype) as w:
        for d in docs:
            w.add_document(d)
    manifest = {
        "format": SHARD_FORMAT, "format_version": SHARD_FORMAT_VERSION,
        "tokenizer_fingerprint": load_tokenizer(tokenizer_dir).fingerprint, "vocab_size": vocab_size,
        "dtype": dtype.name, "num_documents": len(docs), "num_tokens": sum(map(len, docs)),
        "checksums": {"bin": sha256_file(f"{prefix}.bin"), "idx": sha256_file(f"{prefix}.idx")},
    }
    Path(f"{prefix}.json").write_text(json.dumps(manifest, indent=2))


def megatron_sample_index(sizes: np.ndarray, doc_index: np.ndarray, seq_length: int, num_samples: int) -> np.ndarray:
    """(position in doc_index, offset) of each sample start; samples are seq_length + 1 tokens, overlapping by one."""
    out = np.zeros((num_samples + 1, 2), dtype=np.int64)
    pos, offset = 0, 0
    for s in range(1, num_samples + 1):
        remaining = seq_length + 1
        while remaining:
            doc_len = int(sizes[doc_index[pos]]) - offset
            remaining -= doc_len
            if remaining <= 0:
                offset += remaining + doc_len - 1
                remaining = 0
            else:
                pos += 1
                offset = 0
        out[s] = (pos, offset)
    return out


def build_mixture(root: Path, seq_length: int = 64, vocab_size: int = 384, valid_docs: int = 2,
                  seed: int = 0, tokenizer_dir: Path | None = None, texts: list[str] | None = None) -> dict[str, Path]:
    """tokenizer/, shard/stdlib.{bin,idx,json} and mixture/ under root; returns their paths.

    `texts` (default: stdlib_documents()) are the documents, each ended by the EOD token."""
    texts = texts if texts is not None else stdlib_documents()
    tokenizer_dir = tokenizer_dir or train_tokenizer(root / "tokenizer", texts, vocab_size)
    tok = load_tokenizer(tokenizer_dir)
    eod = tok.eos_id
    docs = [tok.encode(t) + [eod] for t in texts]
    prefix = root / "shard" / "stdlib"
    write_shard(prefix, docs, tokenizer_dir, tok.vocab_size)
    sizes = np.array([len(d) for d in docs])
    mix = root / "mixture"
    rng = np.random.default_rng(seed)
    ranges = {"train": (0, len(docs) - valid_docs), "valid": (len(docs) - valid_docs, len(docs))}
    splits, checksums = {}, {}
    for split, (lo, hi) in ranges.items():
        (mix / split).mkdir(parents=True, exist_ok=True)
        doc_index = rng.permutation(np.arange(lo, hi, dtype=np.int32))
        num_samples = (int(sizes[lo:hi].sum()) - 1) // seq_length
        arrays = {
            dataset_file(split, 0, "document_index"): doc_index,
            dataset_file(split, 0, "sample_index"): megatron_sample_index(sizes, doc_index, seq_length, num_samples),
            dataset_file(split, 0, "shuffle_index"): rng.permutation(num_samples).astype(np.int64),
            split_file(split, "dataset_index"): np.zeros(num_samples, dtype=np.uint16),
            split_file(split, "dataset_sample_index"): np.arange(num_samples, dtype=np.int64),
        }
        for rel, arr in arrays.items():
            np.save(mix / rel, arr)
            checksums[rel] = sha256_file(mix / rel)
        splits[split] = {"num_samples": num_samples, "documents": [[lo, hi]]}
    manifest = {
        "format": MIXTURE_FORMAT, "format_version": MIXTURE_FORMAT_VERSION, "seq_length": seq_length,
        "seed": seed, "split": [len(docs) - valid_docs, valid_docs, 0],
        "tokenizer_fingerprint": tok.fingerprint, "vocab_size": tok.vocab_size,
        "datasets": [{"prefix": "../shard/stdlib", "weight": 1.0, "fingerprint": shard_fingerprint(prefix),
                      "num_documents": len(docs), "num_tokens": int(sizes.sum())}],
        "splits": splits, "checksums": checksums,
    }
    (mix / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return {"tokenizer": tokenizer_dir, "shard": prefix, "mixture": mix}


def run_tool(cmd: list[str], cwd: Path, timeout: int = 300, env: dict | None = None):
    """Run a CLI; assert it exits 0 (showing the tail of its output when not)."""
    import subprocess

    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, f"{cmd[0]} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc


def prepare_with_cli(root: Path, bin_dir: Path) -> Path:
    """A real tokenizer + shard + mixture under root, made by `tessera-data prep` and `blend`."""
    with open(root / "corpus.jsonl", "w") as f:
        for text in stdlib_documents():
            f.write(json.dumps({"text": text}) + "\n")
    run_tool([str(bin_dir / "tessera-data"), "prep", "--input", "corpus.jsonl", "--train-tokenizer", "--vocab-size",
              "512", "--output-prefix", "data/stdlib", "--tokenizer-output", "tok", "--quiet"], root)
    run_tool([str(bin_dir / "tessera-data"), "blend", "--data", "1.0", "data/stdlib_text_document", "--seq-length",
              "32", "--split", "8,2,0", "--train-samples", "400", "--valid-samples", "16", "--output", "mix",
              "--quiet"], root)
    return root
