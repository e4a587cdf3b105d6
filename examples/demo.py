"""The whole Tessera pipeline on CPU, end to end, in a few minutes: `make demo`.

1. Corpus: one JSONL document per Python standard-library source file (real text on every machine).
2. tessera-data prep: train a byte-level BPE tokenizer and write Megatron .bin/.idx shards.
3. tessera-data blend: build the train/valid mixture.
4. tessera-train: train the `tiny` Llama preset from the mixture, writing DCP checkpoints.
5. tessera-ckpt export: a Hugging Face Llama directory.
6. tessera-serve: start the server on the checkpoint, ask it for a completion, stop it.

Everything lands under .demo/ (override with TESSERA_DEMO_DIR); each stage prints its artifact.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
WORK = Path(os.environ.get("TESSERA_DEMO_DIR", ROOT / ".demo"))
CORPUS_BYTES = int(os.environ.get("TESSERA_DEMO_CORPUS_BYTES", 12_000_000))
PROMPT = "def parse_args(argv):\n    "


def banner(text: str) -> None:
    print(f"\n\033[1m== {text}\033[0m", flush=True)


def run(*args: str | Path) -> None:
    cmd = [str(a) for a in args]
    print("$ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def stdlib_sources():
    """(path relative to the stdlib, text) of each non-empty stdlib .py file outside tests and
    site-packages, sorted for determinism."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for src in sorted(stdlib.rglob("*.py")):
        if "site-packages" in src.parts or "test" in src.parts:
            continue
        try:
            text = src.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            yield str(src.relative_to(stdlib)), text


def build_corpus(path: Path) -> int:
    """One document per stdlib .py file (`stdlib_sources`), up to CORPUS_BYTES of text; the files
    after the last one are held out (benchmarks/quantization.py --demo reads them)."""
    total = docs = 0
    with open(path, "w", encoding="utf-8") as out:
        for rel, text in stdlib_sources():
            out.write(json.dumps({"text": text, "source": rel}) + "\n")
            total += len(text.encode("utf-8"))
            docs += 1
            if total >= CORPUS_BYTES:
                break
    return docs


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(method: str, url: str, body: dict | None = None, timeout: float = 120) -> dict:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def serve_and_generate(checkpoint: Path, path: str = "/v1/completions", body: dict | None = None) -> dict:
    """Start tessera-serve on `checkpoint`, POST `body` (with the served model's name) to `path`, stop it."""
    port = free_port()
    cmd = [str(BIN / "tessera-serve"), "--checkpoint", str(checkpoint), "--port", str(port)]
    print("$ " + " ".join(cmd), flush=True)
    server = subprocess.Popen(cmd)
    try:
        deadline = time.time() + 300  # the CPU forward is compiled before /health answers
        while True:
            if server.poll() is not None:
                raise SystemExit(f"tessera-serve exited early with code {server.returncode}")
            try:
                http("GET", f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                if time.time() > deadline:
                    raise SystemExit("tessera-serve did not become healthy within 300 s") from None
                time.sleep(0.5)
        model = http("GET", f"http://127.0.0.1:{port}/v1/models")["data"][0]["id"]
        body = body or {"prompt": PROMPT, "max_tokens": 48, "temperature": 0.0}
        return http("POST", f"http://127.0.0.1:{port}{path}", {"model": model, **body})
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()


def main() -> None:
    start = time.time()
    if WORK.exists():
        shutil.rmtree(WORK)
    WORK.mkdir(parents=True)

    banner("1/6 corpus from the Python standard library")
    corpus = WORK / "corpus.jsonl"
    docs = build_corpus(corpus)
    print(f"corpus: {corpus} ({docs} documents, {corpus.stat().st_size / 1e6:.1f} MB)")

    banner("2/6 tessera-data prep: tokenizer + Megatron shards")
    prefix = WORK / "data" / "stdlib"
    run(BIN / "tessera-data", "prep", "--input", corpus, "--json-keys", "text", "--train-tokenizer",
        "--vocab-size", "8192", "--output-prefix", prefix, "--workers", "2")
    shard = Path(f"{prefix}_text_document")
    print(f"shard: {shard}.bin / .idx / .json; tokenizer: {prefix.parent / 'tokenizer'}")

    banner("3/6 tessera-data blend: the train/valid mixture")
    mixture = WORK / "mixture"
    run(BIN / "tessera-data", "blend", "--data", "1.0", shard, "--seq-length", "128", "--split", "98,2,0",
        "--train-samples", "9600", "--valid-samples", "64", "--seed", "1234", "--output", mixture)
    print(f"mixture: {mixture}")

    banner("4/6 tessera-train: the tiny Llama on CPU")
    run_dir = WORK / "run"
    run(BIN / "tessera-train", "--config", ROOT / "examples" / "configs" / "tiny.yaml",
        f"data.mixture={mixture}", f"data.tokenizer={prefix.parent / 'tokenizer'}", f"run_dir={run_dir}")
    checkpoint = run_dir / "checkpoints"
    print(f"checkpoint: {checkpoint} (latest_checkpointed_iteration.txt names the newest)")

    banner("5/6 tessera-ckpt export: Hugging Face Llama directory")
    hf_dir = WORK / "hf"
    run(BIN / "tessera-ckpt", "export", "--format", "hf", "--checkpoint", checkpoint, "--output", hf_dir)
    print(f"hf export: {hf_dir}")

    banner("6/6 tessera-serve: completion over HTTP")
    text = serve_and_generate(checkpoint)["choices"][0]["text"]
    print(f"prompt:     {PROMPT!r}\ncompletion: {text!r}")
    print(f"\ndemo finished in {time.time() - start:.0f} s; artifacts under {WORK}")


if __name__ == "__main__":
    main()
