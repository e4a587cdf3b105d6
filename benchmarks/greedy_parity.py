"""Served greedy output, recorded and compared byte for byte: does a change leave what the server
generates exactly as it was? (issue 27: a refactor must show, not assume, that behaviour is
unchanged.)

`record OUT` writes, for 14 prompts (12 of token ids, 5-105 tokens, half sharing a 40-token prefix;
2 of text) of a tiny fixed-seed Llama checkpoint, 32 greedy tokens each, through every forward
path the engine has on CPU:
  - tessera-generate: eager (chunked prefill), fp8 KV cache, n-gram and draft-model speculation,
    tensor parallel 2, the compiled layer stack;
  - the engine: padded decode graphs (eager and compiled), small chunks without the prefix cache;
  - tessera-serve (engine process), /v1/completions, all prompts concurrently.
`compare BEFORE AFTER` says which files differ. Record on the old code, then on the new, then
compare; the checkpoint is built once under --workdir and reused, so both runs read the same bytes.

    .venv/bin/python benchmarks/greedy_parity.py record /tmp/parity/before     # ~3 minutes on 2 cores
    .venv/bin/python benchmarks/greedy_parity.py compare /tmp/parity/before /tmp/parity/after
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
MAX_TOKENS = 32

# Run in a child so that each engine config starts from a fresh process (as the CLIs do).
ENGINE_CONFIGS = r'''
import json, sys
sys.path.insert(0, sys.argv[1] + "/tests/inference")
from inference_helpers import make_engine, run_all, token_ids
try:
    from tessera.inference.core.sampling_params import SamplingParams
except ImportError:  # code from before the inference package was split by role
    from tessera.inference.core.sampling_params import SamplingParams
prompts = [json.loads(line)["prompt"] for line in open(sys.argv[2])]
ids = [p for p in prompts if isinstance(p, list)]
res = {}
for name, cfg in json.loads(sys.argv[3]).items():
    engine = make_engine(sys.argv[4], seed=0, **cfg)
    params = SamplingParams(max_tokens=int(sys.argv[6]), temperature=0.0)
    outs = run_all(engine, {f"p{i}": (x, params) for i, x in enumerate(ids)})
    res[name] = {k: token_ids(v) for k, v in outs.items()}
    engine.close()
json.dump(res, open(sys.argv[5], "w"), indent=0)
'''


def prompts() -> list[dict]:
    out = []
    for i in range(12):  # 12: more than one CPU decode group of 8
        ids = [(7 * j + 13 * i) % 500 + 2 for j in range(5 + 9 * i)]
        if i % 2:  # a shared 40-token prefix: prefix-cache hits
            ids = [(3 * j) % 480 + 5 for j in range(40)] + ids[:20]
        out.append({"id": f"p{i}", "prompt": ids})
    return out + [{"id": "t0", "prompt": "def wrap(text, width=70):"}, {"id": "t1", "prompt": "import json\nclass"}]


def checkpoint(workdir: Path) -> Path:
    ckpt = workdir / "ckpt"
    if not ckpt.exists():
        sys.path.insert(0, str(REPO / "tests" / "inference"))
        from inference_helpers import make_checkpoint, tiny_config

        make_checkpoint(ckpt, tiny_config(), seed=0)
    return ckpt


def generate(ckpt: Path, pfile: Path, out: Path, compile_cpu: bool, *flags: str) -> None:
    env = dict(os.environ, TESSERA_CPU_COMPILE="1" if compile_cpu else "0")
    t = time.time()
    r = subprocess.run([str(BIN / "tessera-generate"), "--checkpoint", str(ckpt), "--prompts", str(pfile),
                        "--output", str(out), "--max-tokens", str(MAX_TOKENS), "--temperature", "0", "--seed", "0",
                        "--quiet", "--torch-threads", "1", *flags], env=env, capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"{out.name}: tessera-generate failed:\n{r.stderr[-3000:]}")
    print(f"{out.name}: {time.time() - t:.1f} s", flush=True)


def serve(ckpt: Path, items: list[dict], out: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    import httpx

    proc = subprocess.Popen([str(BIN / "tessera-serve"), "--checkpoint", str(ckpt), "--port", str(port), "--quiet",
                             "--torch-threads", "1", "--seed", "0"], env=dict(os.environ, TESSERA_CPU_COMPILE="0"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline or proc.poll() is not None:
                sys.exit(f"tessera-serve did not start: {proc.stderr.read() if proc.poll() is not None else 'timeout'}")
            time.sleep(0.3)
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]

        def one(p: dict) -> tuple[str, dict]:
            r = httpx.post(url + "/v1/completions", timeout=120, json={
                "model": model, "prompt": p["prompt"], "max_tokens": MAX_TOKENS, "temperature": 0})
            r.raise_for_status()
            choice = r.json()["choices"][0]
            return p["id"], {"text": choice["text"], "finish_reason": choice["finish_reason"]}

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            served = dict(pool.map(one, items))
        out.write_text(json.dumps(served, indent=0, sort_keys=True))
    finally:
        proc.terminate()
        proc.wait(30)
    print(f"{out.name}: done", flush=True)


def record(out: Path, workdir: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    ckpt = checkpoint(workdir)
    items = prompts()
    pfile = out / "prompts.jsonl"
    pfile.write_text("".join(json.dumps(p) + "\n" for p in items))
    generate(ckpt, pfile, out / "generate_eager.jsonl", False, "--max-num-batched-tokens", "64")
    generate(ckpt, pfile, out / "generate_fp8kv.jsonl", False, "--kv-cache-dtype", "fp8_e5m2")
    generate(ckpt, pfile, out / "generate_ngram.jsonl", False, "--speculative-config", json.dumps(
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}))
    generate(ckpt, pfile, out / "generate_draft.jsonl", False, "--speculative-config",
             json.dumps({"model": str(ckpt), "num_speculative_tokens": 2}))
    generate(ckpt, pfile, out / "generate_tp2.jsonl", False, "--tensor-parallel", "2")
    generate(ckpt, pfile, out / "generate_compiled.jsonl", True)
    configs = {"engine_padded": {"padded_decode": True},
               "engine_chunked_nocache": {"max_num_batched_tokens": 32, "max_num_seqs": 8,
                                          "enable_prefix_caching": False},
               "engine_padded_compiled": {"padded_decode": True, "cpu_compile": True}}
    t = time.time()
    r = subprocess.run([sys.executable, "-c", ENGINE_CONFIGS, str(REPO), str(pfile), json.dumps(configs), str(ckpt),
                        str(out / "engine.json"), str(MAX_TOKENS)], env=dict(os.environ, TESSERA_CPU_COMPILE="0"),
                       capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"engine configs failed:\n{r.stderr[-3000:]}")
    print(f"engine.json: {time.time() - t:.1f} s", flush=True)
    serve(ckpt, items, out / "served.json")


def compare(before: Path, after: Path) -> int:
    differ = 0
    for f in sorted(before.glob("*.json*")):
        g = after / f.name
        same = g.exists() and f.read_bytes() == g.read_bytes()
        differ += not same
        print(f"{'same  ' if same else 'DIFFER'} {f.name}")
    print(f"{differ} of {len(list(before.glob('*.json*')))} files differ")
    return 1 if differ else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record", help="record greedy outputs into OUT")
    r.add_argument("out", type=Path)
    r.add_argument("--workdir", type=Path, default=Path("/tmp/tessera-greedy-parity"),
                   help="where the fixed-seed checkpoint is built once and reused (default: %(default)s)")
    c = sub.add_parser("compare", help="compare two recordings byte for byte")
    c.add_argument("before", type=Path)
    c.add_argument("after", type=Path)
    args = p.parse_args()
    if args.cmd == "record":
        record(args.out, args.workdir)
        return 0
    return compare(args.before, args.after)


if __name__ == "__main__":
    sys.exit(main())
