"""`tessera-data blend`: the mixture artifact (format: `tessera.common.mixture`), built offline.

Megatron GPT-dataset semantics, per dataset k and split:

1. Documents are divided into train/valid/test ranges by the split ratios (Megatron's rounding).
2. The split's documents are shuffled afresh each epoch and the epochs concatenated
   (`document_index`), as many epochs as the requested samples need.
3. Samples are packed across document boundaries: sample i covers stream tokens
   [i*L, i*L + L] inclusive (L = seq_length), so consecutive samples share one token.
   `sample_index[i]` is (position in document_index, offset) of token i*L.
4. Samples are shuffled within each epoch (`shuffle_index`), so a dataset is seen epoch by epoch.

The blend then assigns global sample n to the dataset with the largest deficit
weight_k * (n + 1) - count_k (ties to the lower k), which keeps every dataset within one sample
of weight_k * n after every n. Every shuffle is seeded from (seed, split, dataset), epochs drawing successive permutations, so the
same inputs and parameters give byte-identical files.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
from pydantic import Field, field_validator

from tessera.common.config import StrictModel, read_yaml, validate_config
from tessera.common.errors import UserError
from tessera.common.fileio import (
    atomic_directory,
    atomic_write_json,
    check_replaceable,
    ensure_output_dir,
    names_os_errors,
    refuse_replacing_inputs,
    sha256_file,
)
from tessera.common.indexed_dataset import IndexedDataset
from tessera.common.mixture import (
    MANIFEST,
    MIXTURE_KIND,
    SPLITS,
    MixtureDatasetEntry,
    MixtureManifest,
    MixtureSplitInfo,
    dataset_file,
    is_mixture_directory,
    split_file,
)
from tessera.common.progress import progress
from tessera.common.shard import ShardManifest, open_shard, read_shard_manifest, shard_fingerprint


class BlendSource(StrictModel):
    prefix: Path = Field(description="Shard prefix (<prefix>.bin/.idx/.json).")
    weight: float = Field(1.0, gt=0, description="Relative weight; weights are normalised to sum to 1.")


class BlendConfig(StrictModel):
    """Parameters of a mixture; the YAML form of `tessera-data blend` uses these field names."""

    data: list[BlendSource] = Field(min_length=1, description="Weighted shard prefixes.")
    seq_length: int = Field(ge=1, description="Tokens per sample; each sample stores seq_length + 1 tokens.")
    split: str = Field("969,30,1", description="Train,valid,test document ratios (Megatron style), e.g. 969,30,1.")
    train_samples: int = Field(ge=1, description="Samples in the train split.")
    valid_samples: int = Field(0, ge=0, description="Samples in the valid split (0: no valid split).")
    test_samples: int = Field(0, ge=0, description="Samples in the test split (0: no test split).")
    seed: int = Field(1234, ge=0, description="Seed of every shuffle.")
    output: Path = Field(description="Mixture directory to create.")
    overwrite: bool = Field(False, description="Replace an existing mixture directory.")
    quiet: bool = Field(False, description="No progress bars.")

    @field_validator("split")
    @classmethod
    def _split(cls, value: str) -> str:
        parse_split(value)
        return value


def parse_split(text: str) -> list[float]:
    """'969,30,1' -> normalised [train, valid, test] fractions (missing parts are 0)."""
    parts = [p.strip() for p in str(text).replace("/", ",").split(",")]
    try:
        values = [float(p) for p in parts]
    except ValueError:
        raise ValueError(f"split {text!r}: expected up to 3 comma-separated numbers, e.g. 969,30,1") from None
    if not 1 <= len(values) <= 3 or any(v < 0 or not np.isfinite(v) for v in values) or sum(values) <= 0:
        raise ValueError(f"split {text!r}: expected 1 to 3 non-negative numbers with a positive sum, e.g. 969,30,1")
    values += [0.0] * (3 - len(values))
    total = sum(values)
    return [v / total for v in values]


def split_ranges(fractions: list[float], num_documents: int) -> list[tuple[int, int]]:
    """Megatron's document split: cumulative rounded boundaries, corrected so the last is D."""
    bounds = [0]
    for f in fractions:
        bounds.append(bounds[-1] + int(round(f * float(num_documents))))
    diff = bounds[-1] - num_documents
    bounds = [bounds[0]] + [b - diff for b in bounds[1:]]
    return [(bounds[i], bounds[i + 1]) for i in range(len(fractions))]


DOCUMENTS, SAMPLES = 0, 1  # the two shuffles of a dataset, each from its own random stream


def _rng(seed: int, split: int, dataset: int, kind: int) -> np.random.Generator:
    """One stream per (seed, split, dataset, shuffle); epochs draw successive permutations from it."""
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, split, dataset, kind])))


def document_lengths(ds: IndexedDataset) -> np.ndarray:
    """Tokens per document (a Megatron document may span several sequences)."""
    seq_ends = np.concatenate([[0], np.cumsum(ds.lengths, dtype=np.int64)])
    return seq_ends[np.asarray(ds.doc_idx, dtype=np.int64)[1:]] - seq_ends[np.asarray(ds.doc_idx, dtype=np.int64)[:-1]]


def blend_assignment(weights: list[float], num_samples: int) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """(dataset_index, dataset_sample_index, per-dataset counts) by largest deficit.

    `deficit[k]` is weight_k * (n + 1) - count_k for the step n about to be decided; the loop
    keeps it up to date by adding the weights once per step, so each step is a handful of
    C-level list operations (max, index, a comprehension) rather than K Python-level ones.
    """
    weights = [float(w) for w in weights]
    deficit = list(weights)  # n = 0: weight_k * 1 - 0
    choices = bytearray() if len(weights) <= 256 else []
    for _ in range(num_samples):
        k = deficit.index(max(deficit))  # first maximum: ties go to the lower dataset number
        choices.append(k)
        deficit[k] -= 1.0
        deficit = [d + w for d, w in zip(deficit, weights)]
    dataset_index = np.frombuffer(bytes(choices), dtype=np.uint8).astype(np.uint16) if isinstance(
        choices, bytearray) else np.asarray(choices, dtype=np.uint16)
    dataset_sample_index = np.zeros(num_samples, dtype=np.int64)
    counts = []
    for k in range(len(weights)):
        mask = dataset_index == k
        counts.append(int(mask.sum()))
        dataset_sample_index[mask] = np.arange(counts[-1], dtype=np.int64)
    return dataset_index, dataset_sample_index, counts


def epochs_needed(doc_lengths: np.ndarray, num_samples: int, seq_length: int) -> int:
    """Passes over these documents that `num_samples` samples of `seq_length` tokens read."""
    needed = num_samples * seq_length + 1  # the last sample's final token must exist
    return -(-needed // int(doc_lengths.sum()))


def build_dataset_indices(doc_lengths: np.ndarray, first: int, last: int, num_samples: int, seq_length: int,
                          seed: int, split_id: int, dataset_id: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(document_index, sample_index, shuffle_index) of one dataset in one split."""
    num_docs = last - first
    epochs = epochs_needed(doc_lengths[first:last], num_samples, seq_length)
    rng = _rng(seed, split_id, dataset_id, DOCUMENTS)
    document_index = np.concatenate([first + rng.permutation(num_docs) for _ in range(epochs)]).astype(np.int32)
    ends = np.cumsum(doc_lengths[document_index], dtype=np.int64)
    starts_tok = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    pos = np.searchsorted(ends, starts_tok, side="right")
    offset = starts_tok - (ends[pos] - doc_lengths[document_index[pos]])
    sample_index = np.stack([pos, offset], axis=1).astype(np.int64)
    # Shuffle samples within the epoch their first token belongs to. Sample starts only move
    # forward, so each epoch's samples are one contiguous run [bounds[g], bounds[g + 1]).
    sample_epoch = pos[:-1] // num_docs
    bounds = np.concatenate([[0], np.flatnonzero(np.diff(sample_epoch)) + 1, [num_samples]])
    rng = _rng(seed, split_id, dataset_id, SAMPLES)
    shuffle_index = np.concatenate([lo + rng.permutation(hi - lo) for lo, hi in zip(bounds[:-1], bounds[1:])])
    return document_index, sample_index, shuffle_index


def parse_data_args(values: list[str], where: str = "--data") -> list[BlendSource]:
    """`--data 0.7 A 0.3 B` (weight, prefix pairs) or `--data A B` (equal weights); `where` names them
    in an error (a YAML file's `data:` list is read here too)."""

    def is_number(s: str) -> bool:
        try:
            float(s)
            return True
        except ValueError:
            return False

    if not any(is_number(v) for v in values):
        return [BlendSource(prefix=Path(v)) for v in values]
    if len(values) % 2 or not all(is_number(values[i]) for i in range(0, len(values), 2)):
        raise UserError(f"{where}: expected WEIGHT PREFIX pairs (e.g. 0.7 data/a 0.3 data/b) or only prefixes")
    out = []
    for i in range(0, len(values), 2):
        w = float(values[i])
        if not w > 0 or not np.isfinite(w):
            raise UserError(f"{where}: weight {values[i]} of {values[i + 1]} must be a positive number")
        out.append(BlendSource(prefix=Path(values[i + 1]), weight=w))
    return out


def load_blend_config(path: str | None, cli: dict) -> BlendConfig:
    """YAML file (if any) with command-line values on top; validated as a whole."""
    data = read_yaml(path) if path else {}  # a non-UTF-8 file is a UserError there
    if isinstance(data.get("data"), list):  # YAML may use [{prefix, weight}] or [weight, prefix, ...]
        items = data["data"]
        if items and not isinstance(items[0], dict):
            data["data"] = [s.model_dump() for s in parse_data_args([str(x) for x in items], f"{path}: data")]
    origins = {}  # a bad flag is reported against the flag, not the file
    for key, value in cli.items():
        if value is not None:
            data[key] = value
            flag = "--" + key.replace("_", "-")
            origins[key] = flag if isinstance(value, (list, bool)) else f"{flag} {value}"
    return validate_config(BlendConfig, data, str(path) if path else "blend arguments", origins)


def _open_sources(cfg: BlendConfig) -> tuple[list[IndexedDataset], list[ShardManifest], list[str]]:
    datasets, manifests, fingerprints = [], [], []
    for src in cfg.data:
        if not Path(f"{src.prefix}.json").is_file():
            candidates = sorted(Path(src.prefix).parent.glob(f"{Path(src.prefix).name}_*_document.json"))
            if candidates:
                raise UserError(f"{src.prefix}.json: shard manifest not found; did you mean the shard prefix "
                                f"{str(candidates[0])[:-5]} (prep writes <output-prefix>_<key>_document)?")
        manifest = read_shard_manifest(src.prefix)
        # The index against the manifest, then every block's checksum and ids, before a mixture pins
        # this shard: ~5 GB/s on one core of this 2-core EPYC (128 MiB shard, loaded machine).
        ds = open_shard(src.prefix, "full")
        datasets.append(ds)
        manifests.append(manifest)
        fingerprints.append(shard_fingerprint(src.prefix))
    first = manifests[0]
    for src, m in zip(cfg.data, manifests):
        if m.tokenizer_fingerprint != first.tokenizer_fingerprint:
            raise UserError(f"{src.prefix}.json: tokenizer {m.tokenizer_fingerprint[:19]}… differs from "
                            f"{cfg.data[0].prefix}'s {first.tokenizer_fingerprint[:19]}…; shards in one mixture "
                            "must share a tokenizer (re-run prep with the same --tokenizer)")
    return datasets, manifests, fingerprints


# Index bytes per requested sample, at least: dataset_index (uint16) + dataset_sample_index
# (int64) + sample_index (2 x int64) + shuffle_index (int64); document indices come on top.
INDEX_BYTES_PER_SAMPLE = 2 + 8 + 16 + 8


def physical_memory() -> int | None:
    """Bytes of RAM (None where the platform does not say): what a blend's indices must fit in."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else None


def check_index_fits(num_samples: int, output_parent: Path) -> None:
    """Refuse at once a request whose index cannot be built: it is held in memory, then written
    under --output (a typo of a few zeros would otherwise run for hours before failing)."""
    need = num_samples * INDEX_BYTES_PER_SAMPLE
    memory = physical_memory()
    parent = output_parent if output_parent.exists() else Path(".")
    free_disk = shutil.disk_usage(parent).free
    for what, have in (("memory", memory), (f"free space under {parent}", free_disk)):
        if have is not None and need > have:
            raise UserError(f"--train/valid/test-samples: {num_samples:,} samples need at least {need / 2**30:,.1f} "
                            f"GiB of index, more than the {have / 2**30:,.1f} GiB of {what}; request fewer samples")


# Peak bytes while build_dataset_indices orders one dataset's documents: the int64 permutations,
# their concatenation, the int32 index kept and the int64 running ends, plus each epoch's array
# object. Measured (ru_maxrss, 10 samples): 25.7 B per entry over 25-document epochs, 200 B per
# epoch of 1 document; these round both up.
DOC_ENTRY_BYTES, DOC_EPOCH_BYTES = 26, 200


def check_document_orders_fit(cfg: BlendConfig, plans: dict, doc_lengths: list[np.ndarray],
                              ranges: list[list[tuple[int, int]]]) -> None:
    """Refuse at once a request whose document order cannot be built: a long --seq-length over a
    small shard repeats its documents once per epoch (seq_length 10^12 over 180k tokens: 1.4
    billion entries), which was killed for memory after minutes instead of refused."""
    memory = physical_memory()
    for split, (split_id, _, _, counts) in plans.items():
        for k, src in enumerate(cfg.data):
            first, last = ranges[k][split_id]
            if not counts[k]:
                continue
            epochs = epochs_needed(doc_lengths[k][first:last], counts[k], cfg.seq_length)
            need = epochs * ((last - first) * DOC_ENTRY_BYTES + DOC_EPOCH_BYTES)
            if memory is not None and need > memory:
                raise UserError(f"--seq-length {cfg.seq_length}: {counts[k]:,} {split} samples read the {last - first:,} "
                                f"{split} documents of {src.prefix} {epochs:,} times, an index of {need / 2**30:,.1f} "
                                f"GiB, more than the {memory / 2**30:,.1f} GiB of memory; request fewer samples or "
                                "a shorter --seq-length")


def run_blend(cfg: BlendConfig) -> Path:
    """Validate everything, then build and atomically publish the mixture directory."""
    if cfg.output.exists() and not cfg.overwrite:
        raise UserError(f"{cfg.output}: already exists; choose another --output or pass --overwrite")
    refuse_replacing_inputs(cfg.output, [Path(f"{s.prefix}.bin") for s in cfg.data])
    check_replaceable(cfg.output, MIXTURE_KIND, is_mixture_directory)
    ensure_output_dir(cfg.output.parent, "--output")
    fractions = parse_split(cfg.split)
    datasets, manifests, fingerprints = _open_sources(cfg)
    total_w = sum(s.weight for s in cfg.data)
    weights = [s.weight / total_w for s in cfg.data]
    requested = {"train": cfg.train_samples, "valid": cfg.valid_samples, "test": cfg.test_samples}
    check_index_fits(sum(requested.values()), cfg.output.parent)
    doc_lengths = [document_lengths(ds) for ds in datasets]
    ranges = [split_ranges(fractions, ds.num_documents) for ds in datasets]

    plans = {}
    for split_id, split in enumerate(SPLITS):
        if requested[split] == 0:
            continue
        dataset_index, dataset_sample_index, counts = blend_assignment(weights, requested[split])
        for k, src in enumerate(cfg.data):
            first, last = ranges[k][split_id]
            if counts[k] and (last <= first or int(doc_lengths[k][first:last].sum()) == 0):
                raise UserError(f"{src.prefix}: no tokens in the {split} split (documents [{first}, {last}) of "
                                f"{datasets[k].num_documents} with --split {cfg.split}); change --split or request "
                                f"0 {split} samples")
        plans[split] = (split_id, dataset_index, dataset_sample_index, counts)
    check_document_orders_fit(cfg, plans, doc_lengths, ranges)

    out_abs = cfg.output.resolve()
    with atomic_directory(cfg.output, overwrite=cfg.overwrite) as tmp:
        checksums: dict[str, str] = {}
        splits_info: dict[str, MixtureSplitInfo] = {}

        def save(rel: str, arr: np.ndarray) -> None:
            path = tmp / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            with names_os_errors(path), open(path, "wb") as f:
                # Through f.write, not numpy's tofile(), which reports a full disk as a short write
                # without an errno (so it was neither recognised nor named).
                np.save(SimpleNamespace(write=f.write), arr, allow_pickle=False)
            checksums[rel] = sha256_file(path)

        work = [(s, k) for s in plans for k in range(len(datasets))]
        for split, k in progress(work, desc="building indices", unit="index", quiet=cfg.quiet):
            split_id, dataset_index, dataset_sample_index, counts = plans[split]
            if k == 0:
                save(split_file(split, "dataset_index"), dataset_index)
                save(split_file(split, "dataset_sample_index"), dataset_sample_index)
            first, last = ranges[k][split_id]
            if counts[k]:
                doc_index, sample_index, shuffle_index = build_dataset_indices(
                    doc_lengths[k], first, last, counts[k], cfg.seq_length, cfg.seed, split_id, k)
            else:
                doc_index = np.zeros(0, np.int32)
                sample_index = np.zeros((1, 2), np.int64)
                shuffle_index = np.zeros(0, np.int64)
            save(dataset_file(split, k, "document_index"), doc_index)
            save(dataset_file(split, k, "sample_index"), sample_index)
            save(dataset_file(split, k, "shuffle_index"), shuffle_index)
        for split, (split_id, _, _, counts) in plans.items():
            splits_info[split] = MixtureSplitInfo(
                num_samples=requested[split], documents=[list(r[split_id]) for r in ranges],
                samples_per_dataset=counts)
        entries = []
        for src, m, fp, w in zip(cfg.data, manifests, fingerprints, weights):
            rel = os.path.relpath(src.prefix.resolve(), out_abs)
            entries.append(MixtureDatasetEntry(prefix=rel, weight=w, fingerprint=fp,
                                               num_documents=m.num_documents, num_tokens=m.num_tokens))
        manifest = MixtureManifest(
            seq_length=cfg.seq_length, seed=cfg.seed, split=fractions,
            tokenizer_fingerprint=manifests[0].tokenizer_fingerprint, vocab_size=manifests[0].vocab_size,
            datasets=entries, splits=splits_info, checksums=dict(sorted(checksums.items())),
            split_string=cfg.split, requested_samples=requested, created_by="tessera-data blend",
            tokenizer=_tokenizer_rel(cfg.data[0].prefix, manifests[0], out_abs))
        atomic_write_json(tmp / MANIFEST, manifest.model_dump(mode="json"))
    if not cfg.quiet:
        print(f"mixture: {cfg.output} (" + ", ".join(f"{s}: {requested[s]} samples" for s in plans) + ")",
              file=sys.stderr)
    return cfg.output


def _tokenizer_rel(prefix: Path, manifest: ShardManifest, out_abs: Path) -> str | None:
    """Where the shards' tokenizer lives, relative to the mixture (a convenience for users)."""
    tok = getattr(manifest, "tokenizer", None) or (manifest.model_extra or {}).get("tokenizer")
    if not tok:
        return None
    path = (prefix.resolve().parent / tok).resolve()
    return os.path.relpath(path, out_abs)

