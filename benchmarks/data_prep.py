"""tessera-data prep throughput and memory against the raw speed of the tokenizer alone.

    .venv/bin/python benchmarks/data_prep.py [--size-mb 200] [--vocab-size 32000] [--workers 1]

1. Generates a JSONL corpus of at least --size-mb from the Python standard library's `.py` files
   (each copy of a file gets a distinct header and renamed identifiers, so documents differ).
2. Trains a byte-level BPE on the first ~16 MB (`tessera.data_prep.tokenizer_train`).
3. Peer: the raw tokenizer — `encode_batch_fast` (or `encode_batch` on older `tokenizers`) over
   the same texts already held in memory, in the same batch sizes, on the same cores.
4. Tessera: the whole `tessera-data prep` CLI as a subprocess (reading, JSON parsing, tokenizing,
   writing .bin/.idx, hashing, manifest), timed wall-clock from launch to exit; peak RSS sampled
   with psutil over the process and all its children.
Prints the figures and the ratio (target: >= 0.85 of raw speed, peak RSS < 1.5 GB).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import re
import resource
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import psutil


def generate_corpus(path: Path, size_mb: int) -> tuple[int, int]:
    """Write >= size_mb of JSONL; returns (documents, bytes)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    sources = []
    for p in sorted(root.rglob("*.py")):
        try:
            text = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if 200 < len(text) < 400_000:
            sources.append((p.relative_to(root).as_posix(), text))
    rng = random.Random(0)
    ident = re.compile(r"\b(self|data|value|result|name|path)\b")
    target, written, docs, copy = size_mb * 1_000_000, 0, 0, 0
    with open(path, "w", encoding="utf-8") as f:
        while written < target:
            for rel, text in sources:
                suffix = f"_{copy}" if copy else ""
                body = ident.sub(lambda m, s=suffix: m.group(0) + s, text) if copy else text
                doc = f"# {rel} (copy {copy}, seed {rng.random():.6f})\n{body}"
                line = json.dumps({"text": doc}) + "\n"
                f.write(line)
                written += len(line)
                docs += 1
                if written >= target:
                    break
            copy += 1
    return docs, written


def train_tokenizer(corpus: Path, out: Path, vocab_size: int, train_mb: int = 16) -> None:
    from tessera.data_prep.tokenizer_train import save_tokenizer, train_bpe

    def texts():
        seen = 0
        with open(corpus, encoding="utf-8") as f:
            for line in f:
                text = json.loads(line)["text"]
                seen += len(text)
                yield text
                if seen > train_mb * 1_000_000:
                    return

    save_tokenizer(train_bpe(texts(), vocab_size), out, 8192)


def raw_tokenizer_speed(corpus: Path, tokenizer_dir: Path, batch_chars: int) -> tuple[float, int, str, float]:
    """Tokens/s of the Rust tokenizer alone over in-memory texts, batched like the pipeline."""
    from tokenizers import Tokenizer

    texts = [json.loads(line)["text"] for line in open(corpus, encoding="utf-8")]
    batches, cur, chars = [], [], 0
    for t in texts:
        cur.append(t)
        chars += len(t)
        if chars >= batch_chars:
            batches.append(cur)
            cur, chars = [], 0
    if cur:
        batches.append(cur)
    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    fast = hasattr(tok, "encode_batch_fast")
    encode = tok.encode_batch_fast if fast else tok.encode_batch
    tokens = 0
    start, cpu_start = time.perf_counter(), time.process_time()
    for b in batches:
        for e in encode(b, add_special_tokens=False):
            tokens += len(e)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    return tokens / seconds, tokens, "encode_batch_fast" if fast else "encode_batch", cpu


def pipeline_speed(cmd: list[str]) -> tuple[float, int, float]:
    """(wall seconds, peak RSS bytes over the process tree, CPU seconds of the tree) of one CLI run."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = psutil.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    peak = 0
    while proc.poll() is None:
        rss = 0
        try:
            rss = proc.memory_info().rss + sum(c.memory_info().rss for c in proc.children(recursive=True))
        except psutil.Error:
            pass
        peak = max(peak, rss)
        time.sleep(0.05)
    seconds = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)  # includes the CLI's own (reaped) workers
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if proc.returncode != 0:
        raise SystemExit(f"pipeline failed ({proc.returncode}): {proc.stderr.read().decode()[-2000:]}")
    return seconds, peak, cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mb", type=int, default=200, help="Corpus size to generate (default 200 MB).")
    ap.add_argument("--vocab-size", type=int, default=32000)
    ap.add_argument("--workers", type=int, default=1, help="--workers passed to tessera-data prep.")
    ap.add_argument("--batch-chars", type=int, default=4_000_000)
    ap.add_argument("--rounds", type=int, default=1, help="Alternating raw/pipeline measurement rounds.")
    ap.add_argument("--keep", type=Path, help="Work in this directory and keep it (default: a temporary one).")
    args = ap.parse_args()

    work = args.keep or Path(tempfile.mkdtemp(prefix="tessera-bench-data-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        corpus = work / "corpus.jsonl"
        t = time.perf_counter()
        docs, nbytes = generate_corpus(corpus, args.size_mb)
        print(f"corpus: {docs:,} documents, {nbytes / 1e6:,.1f} MB ({time.perf_counter() - t:.1f}s to generate)")
        tok = work / "tokenizer"
        t = time.perf_counter()
        train_tokenizer(corpus, tok, args.vocab_size)
        print(f"tokenizer: vocab {args.vocab_size} trained in {time.perf_counter() - t:.1f}s")

        exe = str(Path(sys.executable).parent / "tessera-data")
        cmd = [exe, "prep", "--input", str(corpus), "--json-keys", "text", "--tokenizer", str(tok),
               "--output-prefix", str(work / "out" / "bench"), "--workers", str(args.workers),
               "--batch-chars", str(args.batch_chars), "--quiet", "--overwrite"]
        print(f"tessera command: {' '.join(cmd)}")
        ratios, cpu_ratios = [], []
        for r in range(args.rounds):
            # Alternate the order each round so a change in background load does not favour one side.
            order = ("raw", "pipe") if r % 2 == 0 else ("pipe", "raw")
            for which in order:
                if which == "raw":
                    raw_tps, raw_tokens, method, raw_cpu = raw_tokenizer_speed(corpus, tok, args.batch_chars)
                    print(f"[round {r + 1}] raw tokenizer ({method}, texts in memory): {raw_tokens:,} tokens, "
                          f"{raw_tps:,.0f} tokens/s, {raw_cpu:.1f} CPU-s")
                else:
                    seconds, peak, pipe_cpu = pipeline_speed(cmd)
                    manifest = json.loads((work / "out" / "bench_text_document.json").read_text())
                    pipe_tokens = manifest["num_tokens"] - manifest["num_documents"]  # same tokens, less EODs
                    pipe_tps = pipe_tokens / seconds
                    print(f"[round {r + 1}] tessera-data prep (end to end, --workers {args.workers}): "
                          f"{manifest['num_tokens']:,} tokens ({pipe_tokens:,} + {manifest['num_documents']:,} EOD) "
                          f"in {seconds:.1f}s = {pipe_tps:,.0f} tokens/s, {pipe_cpu:.1f} CPU-s, "
                          f"peak RSS {peak / 2**20:,.0f} MiB")
            assert pipe_tokens == raw_tokens, "pipeline and raw tokenizer disagree on the token count"
            ratios.append(pipe_tps / raw_tps)
            cpu_ratios.append(raw_cpu / pipe_cpu)
            print(f"[round {r + 1}] ratio pipeline / raw tokenizer: wall {ratios[-1]:.3f} (target >= 0.85), "
                  f"CPU efficiency {cpu_ratios[-1]:.3f}; peak RSS {'<' if peak < 1.5e9 else '>='} 1.5 GB")
        ratios.sort()
        print(f"median wall ratio over {len(ratios)} round(s): {ratios[len(ratios) // 2]:.3f}")
        print(f"machine: {platform.processor() or platform.machine()}, {psutil.cpu_count()} cores, "
              f"{psutil.virtual_memory().total / 2**30:.0f} GiB; python {platform.python_version()}")
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
