"""What read-time data integrity costs training, at the demo's shape.

    .venv/bin/python benchmarks/data_integrity.py [--steps 600] [--train-steps 40]

1. Builds the demo's data with the real CLIs: the standard-library corpus, `tessera-data prep`
   (vocab 8192: the shard manifest records block checksums), `tessera-data blend` (seq 128,
   9,600 train samples).
2. Reads the sample batches of a demo-length run (--steps x global batch 16, in the order the
   trainer consumes them) through the trainer's own MixtureBatches, after one warm-up pass, in
   three alternating rounds per mode (the fastest round of each kept), each from a fresh open:
   with `verify="off"` (index structure only) and with `verify="first-read"` (what the trainer
   does: each 1 MiB block's XXH3-64 and token-id range checked the first time it is read), and
   once more opening with `verify="full"` (every block up front).
3. Times the demo's training step: the real `tessera-train` on examples/configs/tiny.yaml for
   --train-steps steps; the median `step_time_s` of its logged steps.
Prints the extra read time over the run as a share of the run's training time (target < 2%), and
the worst single step's extra time against the median step.
4. With --index-documents N (default 10 million; 0 skips it): a synthetic shard of N short
   documents (its manifest with checksums and block checksums), opened with `verify="off"` (index
   structure and its agreement with the manifest) and `"first-read"` (also `.idx` against its
   SHA-256), fastest of 3 each: what a many-document shard adds to every reader's open.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
GLOBAL_BATCH, SEQ = 16, 128


def build_data(work: Path) -> tuple[Path, Path]:
    import importlib.util

    spec = importlib.util.spec_from_file_location("demo", ROOT / "examples" / "demo.py")
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)  # type: ignore[union-attr]
    corpus = work / "corpus.jsonl"
    demo.build_corpus(corpus)
    prefix = work / "data" / "stdlib"
    subprocess.run([BIN / "tessera-data", "prep", "--input", corpus, "--json-keys", "text", "--train-tokenizer",
                    "--vocab-size", "8192", "--output-prefix", prefix, "--workers", "2", "--quiet"], check=True)
    mixture = work / "mixture"
    subprocess.run([BIN / "tessera-data", "blend", "--data", "1.0", f"{prefix}_text_document", "--seq-length",
                    str(SEQ), "--split", "98,2,0", "--train-samples", "9600", "--valid-samples", "64", "--seed",
                    "1234", "--output", mixture, "--quiet"], check=True)
    return mixture, prefix.parent / "tokenizer"


def read_run(mixture: Path, verify: str, steps: int) -> tuple[float, list[float]]:
    """(open seconds, per-step read seconds) for a fresh open with `verify`."""
    from tessera.common.mixture import MixtureSplit
    from tessera.trainer.objectives.batches import MixtureBatches

    t0 = time.perf_counter()
    batches = MixtureBatches(MixtureSplit(mixture, "train", verify=verify), SEQ)
    opened = time.perf_counter() - t0
    per_step = []
    for step in range(steps):
        ids = np.arange(step * GLOBAL_BATCH, (step + 1) * GLOBAL_BATCH)
        t = time.perf_counter()
        batches.batch(ids)
        per_step.append(time.perf_counter() - t)
    return opened, per_step


def train_step_time(mixture: Path, tokenizer: Path, work: Path, steps: int) -> float:
    run_dir = work / "run"
    subprocess.run([BIN / "tessera-train", "--config", ROOT / "examples" / "configs" / "tiny.yaml",
                    f"data.mixture={mixture}", f"data.tokenizer={tokenizer}", f"run_dir={run_dir}",
                    f"training.steps={steps}", "training.log_interval=1", f"training.eval_interval={10**6}",
                    f"training.save_interval={10**6}", "logging.tensorboard=false", "--quiet"], check=True)
    times = [json.loads(line)["step_time_s"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
             if json.loads(line).get("kind") == "train"]
    return statistics.median(times[2:])  # the first steps warm up allocators


def _block_checksums(path: Path, hasher_cls) -> list[str]:
    hasher = hasher_cls()
    hasher.update(path.read_bytes())
    return hasher.finish()


def index_open(work: Path, documents: int) -> tuple[float, float, float]:
    """(.idx MiB, open seconds with verify off, with first-read) of a shard of `documents` short documents."""
    from tessera.common.fileio import sha256_file
    from tessera.common.indexed_dataset import IndexedDatasetWriter
    from tessera.common.shard import (
        BLOCK_SIZE,
        SHARD_FORMAT,
        SHARD_FORMAT_VERSION,
        BlockHasher,
        open_shard,
    )

    prefix = work / "many"
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 8, documents).astype(np.int32)
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        w.add_raw(rng.integers(0, 1000, int(lengths.sum())).astype(np.uint16).tobytes(), lengths)
    manifest = {"format": SHARD_FORMAT, "format_version": SHARD_FORMAT_VERSION, "tokenizer_fingerprint": "sha256:-",
                "vocab_size": 1024, "dtype": "uint16", "num_documents": documents, "num_tokens": int(lengths.sum()),
                "checksums": {"bin": sha256_file(f"{prefix}.bin"), "idx": sha256_file(f"{prefix}.idx")},
                "block_size": BLOCK_SIZE, "block_checksums": _block_checksums(Path(f"{prefix}.bin"), BlockHasher)}
    Path(f"{prefix}.json").write_text(json.dumps(manifest))
    times: dict[str, list[float]] = {"off": [], "first-read": []}
    open_shard(prefix, "off")  # page cache warm for both
    for _ in range(3):
        for mode in times:
            t = time.perf_counter()
            open_shard(prefix, mode)
            times[mode].append(time.perf_counter() - t)
    return Path(f"{prefix}.idx").stat().st_size / 2**20, min(times["off"]), min(times["first-read"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=600, help="Steps of reads (the demo trains 600).")
    ap.add_argument("--train-steps", type=int, default=40, help="Training steps timed for the step time.")
    ap.add_argument("--index-documents", type=int, default=10_000_000,
                    help="Documents of the synthetic shard whose open is timed (0: skip).")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        mixture, tokenizer = build_data(work)
        shard_bytes = sorted((work / "data").glob("*.bin"))[0].stat().st_size
        read_run(mixture, "off", args.steps)  # warm the page cache: both modes then read from memory
        rounds: dict[str, list] = {"off": [], "first-read": []}
        for _ in range(3):  # alternating rounds; each mode's fastest (least disturbed) round is kept
            for mode in rounds:
                rounds[mode].append(read_run(mixture, mode, args.steps))
        off_open, off = min(rounds["off"], key=lambda r: r[0] + sum(r[1]))
        first_open, first = min(rounds["first-read"], key=lambda r: r[0] + sum(r[1]))
        full_open, _ = read_run(mixture, "full", 1)
        step = train_step_time(mixture, tokenizer, work, args.train_steps)
        many = index_open(work, args.index_documents) if args.index_documents else None
    extra = [a - b for a, b in zip(first, off)]
    total_extra = (first_open - off_open) + sum(extra)
    run_time = step * args.steps
    print(f"machine: {platform.processor() or platform.machine()}, {platform.system()}, python {platform.python_version()}")
    print(f"shard: {shard_bytes / 2**20:.1f} MiB ({-(-shard_bytes // 2**20)} blocks of 1 MiB)")
    print(f"reads of {args.steps} steps x {GLOBAL_BATCH} x {SEQ + 1} tokens: off {sum(off) * 1e3:.1f} ms, "
          f"first-read {sum(first) * 1e3:.1f} ms; open: off {off_open * 1e3:.1f} ms, first-read "
          f"{first_open * 1e3:.1f} ms (index .npy checksums), full {full_open * 1e3:.1f} ms (every block)")
    print(f"training step (tiny, batch {GLOBAL_BATCH} x {SEQ}): median {step * 1e3:.1f} ms")
    print(f"integrity cost over the run: {total_extra * 1e3:.1f} ms of {run_time:.1f} s = "
          f"{100 * total_extra / run_time:.3f}% (target < 2%)")
    print(f"worst single step: +{max(extra) * 1e3:.2f} ms = {100 * max(extra) / step:.2f}% of a step")
    if many:
        print(f"open of a {args.index_documents:,}-document shard (.idx {many[0]:.1f} MiB): off {many[1] * 1e3:.0f} ms, "
              f"first-read {many[2] * 1e3:.0f} ms (+{(many[2] - many[1]) * 1e3:.0f} ms: the .idx sha256)")


if __name__ == "__main__":
    main()
