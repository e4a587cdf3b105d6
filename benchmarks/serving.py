"""Serving benchmark, after vLLM's benchmark_serving: our server vs vLLM and transformers peers, same model.

Starts `tessera-serve` as a subprocess on a randomly initialised Llama (default: ~20M parameters,
a scaled-down llama-160m; `--preset llama-25m` for issue #18's 8 layers x 512 with GQA,
`--preset llama-160m` for the real shape), sends N requests over
streaming /v1/completions with at most `--concurrency` in flight (default 32), all at once or as
Poisson arrivals (`--request-rate`, requests/s, as vLLM's benchmark), and reports request throughput,
output tokens/s, TTFT, TPOT and ITL (mean, median, p99). Then, in the same run, on the same
weights and the same prompts/output lengths:
  - naive:  transformers `generate`, one request at a time (a server without batching);
  - static: transformers `generate` on padded static batches of `concurrency` requests
            (each batch runs until its longest request is done; only requested tokens count).
  - vllm:   vLLM's CPU build (`vllm serve`, its OpenAI server) on a Hugging Face export of the same
            checkpoint, asked the same requests by the same client, with the same threads, batch
            limits and KV pool size (benchmarks/vllm_peer.py says how). On by default when
            .venv-vllm/ exists (benchmarks/setup_vllm_cpu.sh makes it), `--peer vllm` insists on it,
            `--no-peer` skips it. Rounds alternate which of tessera-serve and vLLM runs first; the
            ratio Tessera / vLLM of output tok/s is printed per round and as the median.
Requests use ignore_eos so every engine produces exactly the requested number of tokens.

The client (benchmarks/serving_client.py) streams from `--client-processes` worker processes (default:
at most 8 streams each, at most half the CPUs), each on its own event loop, so that on a GPU the
client's CPU per token does not cap TPOT. Each round prints the client's CPU per output token and its
busiest process's utilisation, and a warning when a process was busy over 80% of its wall time (the
run may then be client-bound). On a 2-core machine the default is one process, which competes with
the server for the cores: the per-token CPU is the figure that carries to a bigger machine.

Threads, two modes. Pinned (the default): every system gets `--threads` torch threads, unbound
(tessera-serve `--torch-threads N`; vLLM OMP_NUM_THREADS=N with VLLM_CPU_OMP_THREADS_BIND=nobind;
the transformers peers torch.set_num_threads(N)): the engines compared on equal resources.
`--defaults`: every system as a user gets it, nothing set (tessera-serve without --torch-threads,
which picks its own threads and cores; vLLM without either variable, so its "auto" binding;
transformers at torch's default; OMP_NUM_THREADS removed from the servers' environment); the
startup line of each server says what it chose. `--busy-core` keeps one core busy during the
measured rounds with a process of this script's own (`while True: pass`, unpinned, started after
the warm-up and stopped at the end), as another job on a shared machine would; without it the run
is as quiet as the machine is. Both servers stay up for the whole run, and at their defaults both
bind the same core: the idle one's background threads (vLLM's worker used 1-10% of a core in the
10 s after a run) share it with the one measured; `--no-peer` gives tessera-serve alone.

With `--structured json` the run compares the server with itself instead: the same prompts
JSON-schema constrained (`response_format` json_schema; llguidance masks applied in the batched
sampler) and unconstrained, at equal output lengths. A constrained request ends when its JSON is
complete, usually before its max_tokens, so an unconstrained run of the same max_tokens makes
more tokens per request and spends less of its time per token in prefill: tokens/s would then
compare workloads, not the grammar. So the constrained run goes first, each request's completion
token count is recorded, and the unconstrained run asks for exactly that many tokens (max_tokens
= the count, ignore_eos). Rounds alternate which system runs first. Printed per round and as
medians: output tokens/s, TPOT, and the cost ratio 1 - constrained / unconstrained tokens/s.
Goal: under 10% at 32 concurrent requests on CPU.

    .venv/bin/python benchmarks/serving.py --num-requests 64 --concurrency 32
    .venv/bin/python benchmarks/serving.py --preset llama-25m --output-len 64 64 --num-requests 128 --concurrency 32
    .venv/bin/python benchmarks/serving.py --structured json --num-requests 128 --concurrency 32 --rounds 4
    .venv/bin/python benchmarks/serving.py --preset llama-25m --output-len 64 64 --num-requests 128 --concurrency 32 --defaults --busy-core
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import vllm_peer  # benchmarks/vllm_peer.py (this directory is on sys.path when run as a script)

# run_client: serving_profile.py imports it from here
from serving_client import ServerCpu, describe, describe_server, run_client


def build_checkpoint(root: Path, preset: str, make_config=None) -> tuple[Path, object]:
    """A random model of `preset` (or of make_config(vocab_size)) with a BPE tokenizer of source text."""
    import inspect
    import json as _json
    import textwrap

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from tessera.common.checkpoint import (
        CheckpointSidecar,
        finalize_checkpoint,
        save_model_tensors,
        write_pointer,
    )
    from tessera.common.models.causal_lm.config import ModelConfig
    from tessera.common.models.causal_lm.config import preset as model_preset
    from tessera.common.models.causal_lm.model import build_model

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=2048, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([inspect.getsource(m) for m in (textwrap, _json.decoder, _json.encoder)], trainer)
    vocab = tok.get_vocab_size()  # every id the model can emit decodes to text
    if make_config is not None:
        cfg = make_config(vocab)
    elif preset in ("llama-160m", "llama-1b"):
        cfg = model_preset(preset, vocab_size=vocab, max_seq_len=1024)
    elif preset == "llama-25m":  # issue #18's CPU comparison with vLLM: 8 layers x 512, GQA 8/2, fp32
        cfg = ModelConfig(arch="llama", vocab_size=vocab, hidden_size=512, num_layers=8, num_heads=8,
                          num_kv_heads=2, ffn_hidden_size=1408, max_seq_len=1024)
    else:  # llama-20m: llama-160m's recipe scaled down for a 2-core CPU
        cfg = ModelConfig(arch="llama", vocab_size=vocab, hidden_size=384, num_layers=6, num_heads=6,
                          num_kv_heads=6, ffn_hidden_size=1024, max_seq_len=1024)
    it = root / "checkpoints" / "iter_0000001"
    it.mkdir(parents=True)
    model = build_model(cfg, seed=0)
    save_model_tensors(it, dict(model.state_dict()))
    (it / "tokenizer").mkdir()
    tok.save(str(it / "tokenizer" / "tokenizer.json"))
    (it / "tokenizer" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    finalize_checkpoint(it, CheckpointSidecar(model=cfg, step=1))
    write_pointer(root / "checkpoints", 1)
    return root, model


def hf_model_from(model) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    c = model.cfg
    hf = LlamaForCausalLM(LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.ffn_hidden_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads, num_key_value_heads=c.kv_heads,
        max_position_embeddings=c.max_seq_len, rms_norm_eps=c.norm_eps, rope_theta=c.rope_theta,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=0))
    state = {}
    for name, t in model.state_dict().items():
        n = name.replace("layers.", "model.layers.").replace(".attn.", ".self_attn.")
        n = n.replace("attn_norm", "input_layernorm").replace("mlp_norm", "post_attention_layernorm")
        n = {"embed_tokens.weight": "model.embed_tokens.weight", "final_norm.weight": "model.norm.weight"}.get(n, n)
        state[n] = t
    hf.load_state_dict(state, strict=False)
    return hf.eval()


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))] if xs else float("nan")


# --structured json: what every constrained request must produce (an object holding a list that
# can grow, so generation length stays comparable to the unconstrained run's).
JSON_SCHEMA = {
    "type": "object",
    "properties": {"items": {"type": "array", "items": {
        "type": "object", "properties": {"id": {"type": "integer"}, "name": {"type": "string", "maxLength": 24},
                                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}}},
        "required": ["id", "name", "tags"], "additionalProperties": False}}},
    "required": ["items"], "additionalProperties": False,
}
STRUCTURED_BODY = {"response_format": {"type": "json_schema", "json_schema": {"name": "bench", "schema": JSON_SCHEMA}}}


def _sync(hf) -> None:
    if hf.device.type == "cuda":
        torch.cuda.synchronize(hf.device)


def run_naive(hf, workload, limit: int) -> dict:
    tokens, t0 = 0, time.perf_counter()
    for prompt, n_out in workload[:limit]:
        with torch.no_grad():
            hf.generate(torch.tensor([prompt], device=hf.device),
                        attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=hf.device),
                        max_new_tokens=n_out, min_new_tokens=n_out, do_sample=False, pad_token_id=0)
        tokens += n_out
    _sync(hf)
    dur = time.perf_counter() - t0
    return {"duration": dur, "output_tok_per_s": tokens / dur, "requests": limit}


def run_static(hf, workload, batch: int) -> dict:
    tokens, t0 = 0, time.perf_counter()
    for i in range(0, len(workload), batch):
        chunk = workload[i:i + batch]
        width = max(len(p) for p, _ in chunk)
        ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in chunk])  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in chunk])
        n_max = max(n for _, n in chunk)
        with torch.no_grad():
            hf.generate(ids.to(hf.device), attention_mask=mask.to(hf.device), max_new_tokens=n_max,
                        min_new_tokens=n_max, do_sample=False, pad_token_id=0)
        tokens += sum(n for _, n in chunk)
    _sync(hf)
    dur = time.perf_counter() - t0
    return {"duration": dur, "output_tok_per_s": tokens / dur}


def physical_floor(model, dtype: torch.dtype, device: str, batch: int, context: float) -> dict:
    """The shortest a decode step of `batch` sequences at mean `context` tokens can take on this device.

    Bytes read per step: every weight the step multiplies by (all parameters except an untied input
    embedding, of which only `batch` rows are read) plus the K and V of every cached token, all layers.
    FLOPs per step: 2 per weight per sequence, plus attention's QK^T and AV (4 * context * q_size per
    layer per sequence). Measured here, with the benchmark's thread count: bandwidth as the best of 5
    copies of a 256 MiB tensor (read + write bytes / time), peak as the best of 5 square matmuls in the
    serving dtype (2 n^3 FLOPs, n = 2048). Floor = max(bytes / bandwidth, FLOPs / peak): TPOT can not
    beat it, so TPOT / floor is how far the engine is from the hardware's limit.
    """
    cfg, esize = model.cfg, torch.finfo(dtype).bits // 8

    def best(fn, n=5) -> float:
        times = []
        for _ in range(n):
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            t = time.perf_counter()
            fn()
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        return min(times)

    src = torch.empty(2**28 // esize, dtype=dtype, device=device)
    dst = torch.empty_like(src)
    src.fill_(1)
    bandwidth = 2 * src.numel() * esize / best(lambda: dst.copy_(src))
    a = torch.randn(2048, 2048, device=device).to(dtype)
    peak = 2 * 2048**3 / best(lambda: a @ a)
    weights = sum(p.numel() for p in model.parameters())
    if not cfg.tie_embeddings:
        weights -= model.embed_tokens.weight.numel()
    kv = batch * context * cfg.num_layers * 2 * cfg.kv_size
    read = (weights + kv) * esize
    flops = batch * (2 * weights + 4 * context * cfg.q_size * cfg.num_layers)
    return {"bandwidth": bandwidth, "peak": peak, "bytes": read, "flops": flops,
            "floor": max(read / bandwidth, flops / peak)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=["llama-20m", "llama-25m", "llama-160m", "llama-1b"], default="llama-20m")
    ap.add_argument("--num-requests", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--input-len", type=int, nargs=2, default=[16, 64], help="prompt length range (uniform)")
    ap.add_argument("--output-len", type=int, nargs=2, default=[8, 128], help="output length range (uniform)")
    ap.add_argument("--request-rate", type=float, default=float("inf"),
                    help="Poisson arrivals at this many requests/s (default inf: all at once, "
                         "bounded by --concurrency)")
    ap.add_argument("--naive-requests", type=int, default=8, help="requests the naive peer runs (it is slow)")
    ap.add_argument("--no-hf", action="store_true",
                    help="skip the transformers peers (naive, static): they are slow at 2 threads beside a busy core")
    ap.add_argument("--max-num-batched-tokens", type=int, default=256, help="server step token budget")
    ap.add_argument("--rounds", type=int, default=2, help="alternate the three systems this many times")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--client-processes", type=int, default=None, metavar="P",
                    help="client processes the requests are streamed from (default: at most 8 streams per "
                         "process, at most half the CPUs; benchmarks/serving_client.py)")
    ap.add_argument("--threads", type=int, default=1,
                    help="pinned mode: torch CPU threads for the server and the peers alike (1 suits a shared machine)")
    ap.add_argument("--defaults", action="store_true",
                    help="every system at its own thread defaults instead of --threads (see above)")
    ap.add_argument("--busy-core", action="store_true",
                    help="keep one core busy with a spinning process during the measured rounds")
    ap.add_argument("--device", default="cpu",
                    help="cpu or cuda: the server and the transformers peers alike (fp32 on CPU, bf16 on CUDA)")
    ap.add_argument("--enforce-eager", action="store_true",
                    help="serve with --enforce-eager (no CUDA graphs for decode steps) to compare")
    ap.add_argument("--async-scheduling", action="store_true",
                    help="serve with --async-scheduling (each decode step planned and launched while the one "
                         "before runs)")
    ap.add_argument("--api-server-count", type=int, default=1,
                    help="serve with --api-server-count N (N HTTP processes in front of the engine process; "
                         "each run prints every server process's share of a core)")
    ap.add_argument("--engine-thread", action="store_true",
                    help="serve with --no-engine-process (engine thread in the HTTP process) to compare")
    ap.add_argument("--structured", choices=["none", "json"], default="none",
                    help="json: compare the server unconstrained vs every request JSON-schema constrained "
                         "(no transformers peers)")
    ap.add_argument("--peer", choices=["vllm"], default=None,
                    help="vllm: also serve with vLLM's CPU build (default: when .venv-vllm/bin/python exists)")
    ap.add_argument("--no-peer", action="store_true", help="skip the vLLM peer")
    ap.add_argument("--peer-startup-timeout", type=float, default=900,
                    help="seconds vLLM may take to load and compile before the run gives up")
    args = ap.parse_args()
    if args.client_processes is not None and args.client_processes < 1:
        ap.error("--client-processes: must be at least 1")
    use_vllm = args.structured == "none" and not args.no_peer and (args.peer == "vllm" or vllm_peer.available())
    if args.peer == "vllm" and not vllm_peer.available():
        ap.error(f"--peer vllm: {vllm_peer.VENV}/bin/python not found; run benchmarks/setup_vllm_cpu.sh first")
    if args.peer == "vllm" and args.device != "cpu":
        ap.error("--peer vllm: the peer is vLLM's CPU build; use --device cpu")
    if use_vllm and args.device != "cpu":
        use_vllm = False
    if not args.defaults:
        torch.set_num_threads(args.threads)
    threads_mode = ("defaults (no thread settings)" if args.defaults
                    else f"pinned: {args.threads} torch thread(s) each, unbound")

    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    rng = random.Random(args.seed)
    workdir = Path(tempfile.mkdtemp(prefix="tessera-bench-"))
    ckpt, model = build_checkpoint(workdir / "run", args.preset)
    vocab = model.cfg.vocab_size
    workload = [([rng.randrange(1, vocab) for _ in range(rng.randint(*args.input_len))], rng.randint(*args.output_len))
                for _ in range(args.num_requests)]
    arrivals = None
    if args.request_rate != float("inf"):
        arrivals, t = [], 0.0
        for _ in workload:
            t += rng.expovariate(args.request_rate)
            arrivals.append(t)
    port = free_port()
    kv_tokens = 65536
    cmd = [sys.executable, "-m", "tessera.inference", "--checkpoint", str(ckpt), "--port", str(port), "--quiet",
           "--max-num-seqs", str(args.concurrency), "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--kv-cache-tokens", str(kv_tokens),
           "--device", args.device, "--dtype", "bfloat16" if dtype == torch.bfloat16 else "float32"] \
        + ([] if args.defaults else ["--torch-threads", str(args.threads)]) \
        + (["--no-engine-process"] if args.engine_thread else []) + (["--enforce-eager"] if args.enforce_eager else []) \
        + (["--async-scheduling"] if args.async_scheduling else []) \
        + (["--api-server-count", str(args.api_server_count)] if args.api_server_count != 1 else [])
    env = {**os.environ}
    if args.defaults:
        env.pop("OMP_NUM_THREADS", None)
    vllm = vllm_url = None
    if use_vllm:  # started first: it loads and compiles while tessera-serve starts
        vllm_port = free_port()
        vllm_url = f"http://127.0.0.1:{vllm_port}"
        vllm_log = workdir / "vllm.log"
        vllm = vllm_peer.start(
            vllm_peer.export_hf_model(ckpt, workdir / "hf"), vllm_port, threads=None if args.defaults else args.threads,
            kv_gib=vllm_peer.kv_space_gib(model.cfg, kv_tokens, dtype), max_num_seqs=args.concurrency,
            max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=model.cfg.max_seq_len, dtype=dtype,
            log_path=vllm_log)
    server_log = workdir / "tessera-serve.log"
    # Each server, and the busy core's spinner, in a session of its own: with the kernel's autogroup
    # scheduling (/proc/sys/kernel/sched_autogroup_enabled) a session shares one CPU share, so a
    # server left in this script's session would share it with the client and the spinner while
    # vLLM (vllm_peer.start: a new session) would not.
    with open(server_log, "w") as log:
        server = subprocess.Popen(cmd, env=env, stderr=log, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    spinner = None
    try:
        # Warm-up: every batch size up to --concurrency once (a server that compiles per shape,
        # as vLLM's CPU build can, does so before the measured runs), short outputs.
        warm = [(p, min(n, 8)) for p, n in workload[:args.concurrency]]
        wait_healthy(url, server, 300, "tessera-serve")  # compiles the CPU forward first (~20 s quiet, 80-110 s loaded)
        asyncio.run(run_client(url, warm, args.concurrency, processes=args.client_processes))
        if vllm is not None:
            wait_healthy(vllm_url, vllm, args.peer_startup_timeout, f"vllm serve (log: {vllm_log}; --no-peer skips it)")
            asyncio.run(run_client(vllm_url, warm, args.concurrency, processes=args.client_processes))
        print(f"threads: {threads_mode}; tessera-serve: {startup_threads(server_log)}"
              + (f"; vLLM: {vllm_peer.thread_binding(vllm_log)}" if vllm is not None else ""), flush=True)
        if args.busy_core:
            spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
        if args.structured == "json":
            structured_rounds(url, workload, args, arrivals)
            return
        hf = None if args.no_hf else hf_model_from(model).to(device=args.device, dtype=dtype)
        # The machine is shared: load changes by the minute. Alternate the systems in rounds so
        # each comparison is between runs taken close together.
        # tessera-serve and vLLM alternate which goes first (and so which follows the HF peers).
        rounds = []
        server_cpu = ServerCpu(server.pid)
        for r in range(args.rounds):
            theirs = None
            if vllm_url is not None and r % 2 == 1:
                theirs = asyncio.run(run_client(vllm_url, workload, args.concurrency, arrivals, processes=args.client_processes))
            server_cpu.start()
            ours = asyncio.run(run_client(url, workload, args.concurrency, arrivals, processes=args.client_processes))
            ours["server"] = server_cpu.stop()
            if vllm_url is not None and r % 2 == 0:
                theirs = asyncio.run(run_client(vllm_url, workload, args.concurrency, arrivals, processes=args.client_processes))
            static = naive = None
            if hf is not None:
                static = run_static(hf, workload, args.concurrency)
                naive = run_naive(hf, workload, args.naive_requests)
            rounds.append((ours, static, naive, theirs))
            peer = "" if theirs is None else (f", vLLM {theirs['output_tok_per_s']:.1f} tok/s "
                                              f"(Tessera/vLLM {ours['output_tok_per_s'] / theirs['output_tok_per_s']:.2f}x)")
            hf_peers = "" if static is None else (f", HF static batch {static['output_tok_per_s']:.1f} tok/s, "
                                                  f"HF naive {naive['output_tok_per_s']:.1f} tok/s")
            print(f"round {r + 1}: tessera-serve {ours['output_tok_per_s']:.1f} tok/s{peer}{hf_peers}", flush=True)
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait()
        server.terminate()
        server.wait(timeout=60)
        if vllm is not None:
            vllm_peer.stop(vllm)

    ms = lambda xs: f"mean {1e3 * statistics.mean(xs):7.1f}  median {1e3 * statistics.median(xs):7.1f}  p99 {1e3 * pct(xs, 99):7.1f} ms"  # noqa: E731
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {args.preset} (random weights, {n_params / 1e6:.1f}M params), {str(dtype).removeprefix('torch.')}, {args.device}, threads {threads_mode}, "
          f"{'one core kept busy, ' if args.busy_core else ''}{len(os.sched_getaffinity(0))} CPUs, "
          f"engine {'thread in the HTTP process' if args.engine_thread else 'in its own process'}"
          + (", CUDA graphs for decode steps" if args.device.startswith("cuda") and not args.enforce_eager else ""))
    print(f"command: {' '.join(sys.argv)}")
    rate = "all at once" if arrivals is None else f"Poisson arrivals at {args.request_rate:g} req/s"
    print(f"workload: {args.num_requests} requests ({rate}), concurrency {args.concurrency}, input {args.input_len}, "
          f"output {args.output_len} tokens (ignore_eos); naive peer runs the first {args.naive_requests}")
    c = rounds[0][0]["client"] if rounds else {"processes": 0, "http": "-", "loop": "-"}
    print(f"client: {c['processes']} process(es) ({'--client-processes' if args.client_processes else 'default'}), "
          f"{c['http']}, {c['loop']}, at most {-(-args.concurrency // max(1, c['processes']))} streams each")
    ctx = statistics.mean(len(p) for p, _ in workload) + statistics.mean(n for _, n in workload) / 2
    lim = physical_floor(model, dtype, args.device, args.concurrency, ctx)
    print(f"physical floor of a decode step ({args.concurrency} seqs x {ctx:.0f} tokens of context): "
          f"{lim['bytes'] / 2**20:.1f} MiB / {lim['bandwidth'] / 1e9:.1f} GB/s (copy) and "
          f"{lim['flops'] / 1e9:.2f} GFLOP / {lim['peak'] / 1e9:.1f} GFLOP/s (matmul) -> {1e3 * lim['floor']:.2f} ms")
    for r, (ours, static, naive, theirs) in enumerate(rounds, 1):
        print(f"--- round {r}")
        print(f"tessera-serve : {ours['requests_per_s']:.2f} req/s, {ours['output_tok_per_s']:.1f} output tok/s "
              f"({ours['duration']:.1f} s)")
        print(f"  TTFT {ms(ours['ttft'])}\n  TPOT {ms(ours['tpot'])}\n  ITL  {ms(ours['itl'])}\n  E2E  {ms(ours['e2e'])}")
        print(f"  TPOT median / physical floor: {statistics.median(ours['tpot']) / lim['floor']:.1f}x")
        print("  " + describe(ours["client"]).replace("\n", "\n  "))
        print("  " + describe_server(ours["server"]))
        if static is not None:
            print(f"HF naive (1 at a time): {naive['output_tok_per_s']:.1f} output tok/s")
            print(f"HF static batch ({args.concurrency}, padded): {static['output_tok_per_s']:.1f} output tok/s "
                  f"({static['duration']:.1f} s)")
            print(f"ratio vs naive: {ours['output_tok_per_s'] / naive['output_tok_per_s']:.2f}x   "
                  f"vs static batch: {ours['output_tok_per_s'] / static['output_tok_per_s']:.2f}x   "
                  f"TTFT p50 {1e3 * statistics.median(ours['ttft']):.0f} ms")
        if theirs is not None:
            print(f"vLLM (CPU build, {'second' if r % 2 else 'first'} of the two): {theirs['output_tok_per_s']:.1f} output tok/s "
                  f"({theirs['duration']:.1f} s), TTFT p50 {1e3 * statistics.median(theirs['ttft']):.0f} ms, "
                  f"TPOT p50 {1e3 * statistics.median(theirs['tpot']):.1f} ms (tessera-serve: TPOT p50 "
                  f"{1e3 * statistics.median(ours['tpot']):.1f} ms)")
            print("  vLLM's " + describe(theirs["client"]).replace("\n", "\n  "))
            if theirs["completion_tokens"] != ours["completion_tokens"]:
                print("warning: vLLM's per-request output lengths differ from tessera-serve's")
            print(f"Tessera / vLLM output tok/s: {ours['output_tok_per_s'] / theirs['output_tok_per_s']:.2f}x")
    peers = [(ours, theirs) for ours, _, _, theirs in rounds if theirs is not None]
    if peers:
        ratio = statistics.median(o["output_tok_per_s"] / t["output_tok_per_s"] for o, t in peers)
        print(f"median over {len(peers)} rounds: Tessera / vLLM output tok/s {ratio:.2f}x "
              f"(tessera-serve {statistics.median(o['output_tok_per_s'] for o, _ in peers):.1f}, "
              f"vLLM {statistics.median(t['output_tok_per_s'] for _, t in peers):.1f}; goal >= 1.0x); vLLM threads: "
              + ("its defaults" if args.defaults else f"OMP_NUM_THREADS={args.threads}, VLLM_CPU_OMP_THREADS_BIND=nobind")
              + f", VLLM_CPU_KVCACHE_SPACE={vllm_peer.kv_space_gib(model.cfg, kv_tokens, dtype)} GiB"
              + (", one core kept busy" if args.busy_core else ""))


def startup_threads(log_path: Path) -> str:
    """What tessera-serve's startup line says about its threads."""
    for line in log_path.read_text(errors="replace").splitlines():
        if line.startswith("tessera-serve:") and "; listening" in line:
            return line.split("; listening")[0].split("max_model_len ")[-1].partition("; ")[2]
    return "?"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float, name: str) -> None:
    import httpx

    deadline = time.time() + timeout
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.time() > deadline or proc.poll() is not None:
            raise SystemExit(f"{name} failed to start")
        time.sleep(0.5)


def structured_rounds(url: str, workload, args, arrivals) -> None:
    """The same prompts JSON-schema constrained and unconstrained at equal output lengths: the
    first constrained run records each request's completion token count, and every unconstrained
    run asks for exactly those counts (ignore_eos). Round 1 runs constrained first (it has to);
    later rounds alternate, so neither system always runs on the warmer machine."""
    asyncio.run(run_client(url, workload[:4], 4, extra_body=STRUCTURED_BODY, processes=args.client_processes))  # warm-up (grammar tokenizer)
    free_workload = None
    results: dict[str, list[dict]] = {"free": [], "json": []}
    for r in range(args.rounds):
        for name in ("json", "free") if r % 2 == 0 else ("free", "json"):
            if name == "json":
                res = asyncio.run(run_client(url, workload, args.concurrency, arrivals, extra_body=STRUCTURED_BODY, processes=args.client_processes))
                if free_workload is None:
                    free_workload = [(p, n) for (p, _), n in zip(workload, res["completion_tokens"])]
                    if min(res["completion_tokens"]) < 1:
                        raise SystemExit("a constrained request produced no tokens (see the server log)")
            else:
                res = asyncio.run(run_client(url, free_workload, args.concurrency, arrivals, processes=args.client_processes))
            results[name].append(res)
            print(f"round {r + 1} {name:4s}: {res['output_tok_per_s']:.1f} output tok/s, "
                  f"{sum(res['completion_tokens'])} tokens, {res['requests_per_s']:.2f} req/s, "
                  f"TPOT median {1e3 * statistics.median(res['tpot']):.1f} ms, TTFT median "
                  f"{1e3 * statistics.median(res['ttft']):.0f} ms ({res['duration']:.1f} s); "
                  + describe(res["client"]), flush=True)
    assert free_workload is not None
    lengths = [n for _, n in free_workload]
    print(f"command: {' '.join(sys.argv)}")
    print(f"workload: {args.num_requests} requests, concurrency {args.concurrency}, input {args.input_len}, "
          f"max output {args.output_len} tokens, greedy; output lengths set by the constrained run: "
          f"mean {statistics.mean(lengths):.1f}, min {min(lengths)}, max {max(lengths)} tokens")
    unequal = sum(res["completion_tokens"] != lengths for res in results["json"] + results["free"])
    if unequal:
        print(f"warning: {unequal} runs' per-request output lengths differ from the first constrained run's")

    def median(name: str, key: str) -> float:
        if key == "tpot":
            return statistics.median(statistics.median(res["tpot"]) for res in results[name])
        return statistics.median(res[key] for res in results[name])

    free, constrained = median("free", "output_tok_per_s"), median("json", "output_tok_per_s")
    print(f"median output tok/s: unconstrained {free:.1f}, JSON-schema constrained {constrained:.1f}; "
          f"TPOT median {1e3 * median('free', 'tpot'):.1f} vs {1e3 * median('json', 'tpot'):.1f} ms "
          f"-> grammar cost {100 * (1 - constrained / free):.1f}% of output tok/s (goal < 10%)")


if __name__ == "__main__":
    main()
