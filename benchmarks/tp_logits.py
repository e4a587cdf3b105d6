"""Tensor-parallel decode with each step's logits rows returned through the buffer rank 0 shares
with the driver (worker/tensor_parallel/logits_mailbox.py) against the same engine returning them over the pipe as
raw bytes (the path before it, still taken by a step whose rows exceed the buffer): same weights,
prompts and workers' threads; the engines alternate which runs first each round and must give the
same tokens (engine_race.py).

Every decode step returns [sequences, vocabulary] fp32 rows; `--vocab` (default Llama 3's 128256)
makes them as large as a real model's. The model is otherwise small (`--hidden`, `--layers`), so the
step is mostly what a GPU's forward would leave to the host. Prints seconds per engine step
(median of the rounds), the logits bytes per decode step and the ratio of the two paths.

    .venv/bin/python benchmarks/tp_logits.py                      # 64 sequences, TP2, vocab 128256
    .venv/bin/python benchmarks/tp_logits.py --smoke              # seconds
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_race import checked_race  # noqa: E402
from serving import build_checkpoint  # noqa: E402


def tp_arguments(ap: argparse.ArgumentParser, *, vocab: int, prompt_len: int, max_tokens: int) -> None:
    """The model and workload flags of the tensor-parallel serving benchmarks (this one, tp_decode.py)."""
    ap.add_argument("--tensor-parallel", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=vocab)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--num-prompts", type=int, default=64, help="sequences decoding together")
    ap.add_argument("--prompt-len", type=int, default=prompt_len)
    ap.add_argument("--max-tokens", type=int, default=max_tokens)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the driver and of each worker")
    ap.add_argument("--smoke", action="store_true", help="a tiny run that checks the script (seconds)")


def tp_workload(args, prefix: str, max_seq_len: int) -> tuple[Path, list[list[int]]]:
    """A random Llama checkpoint of the flags' shape (as many heads as ranks, at least 2) and the
    prompts: random token ids, the same every run."""
    from tessera.common.models.causal_lm.config import ModelConfig

    root = Path(tempfile.mkdtemp(prefix=prefix)) / "run"
    heads = max(2, args.tensor_parallel)
    ckpt, _ = build_checkpoint(root, "custom", lambda _: ModelConfig(
        arch="llama", vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers, num_heads=heads,
        num_kv_heads=heads, ffn_hidden_size=2 * args.hidden, max_seq_len=max_seq_len))
    rng = random.Random(0)
    return ckpt, [[rng.randrange(1, args.vocab) for _ in range(args.prompt_len)] for _ in range(args.num_prompts)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    tp_arguments(ap, vocab=128256, prompt_len=16, max_tokens=32)
    args = ap.parse_args()
    if args.smoke:
        args.vocab, args.num_prompts, args.max_tokens, args.rounds = 4096, 8, 4, 1
    torch.set_num_threads(args.threads)

    from tessera.inference.config import EngineConfig
    from tessera.inference.engine.llm_engine import LLMEngine
    from tessera.inference.worker.cpu_threads import Binding
    from tessera.inference.worker.loader import load_for_serving
    from tessera.inference.worker.tensor_parallel import logits_mailbox

    ckpt, prompts = tp_workload(args, "tessera-tp-logits-", 1024)
    cpu = torch.device("cpu")
    cfg = EngineConfig(max_num_seqs=args.num_prompts, max_num_batched_tokens=max(256, args.num_prompts),
                       tensor_parallel=args.tensor_parallel, kv_cache_tokens=args.num_prompts * 128,
                       dtype="float32", device="cpu", enforce_eager=True)
    workers = (Binding(args.threads),) * args.tensor_parallel
    engines, steps = {}, {}
    make = logits_mailbox.LogitsMailbox.make
    for name in ("shared buffer", "pipe"):
        if name == "pipe":  # the same build with no buffer: every step's rows go over the pipe
            logits_mailbox.LogitsMailbox.make = classmethod(lambda cls, *a: None)
        loaded = load_for_serving(str(ckpt), cpu, torch.float32, tensor_parallel=args.tensor_parallel)
        engines[name] = engine = LLMEngine(loaded, cfg, cpu, torch.float32, worker_threads=workers)
        logits_mailbox.LogitsMailbox.make = make
        assert (engine.runner.executor.mailbox is not None) == (name == "shared buffer"), name
        steps[name] = 0

        def counted(step=engine.step, name=name):
            steps[name] += 1
            return step()

        engine.step = counted
    try:
        raced = checked_race("tp_logits", engines, prompts, args.max_tokens, args.rounds,
                             same=("shared buffer", "pipe"))
    finally:
        for engine in engines.values():
            engine.close()
    if raced is None:
        return 1
    secs, _ = raced
    mb = args.num_prompts * args.vocab * 4 / 1e6
    print(f"TP{args.tensor_parallel}, {args.num_prompts} sequences x {args.max_tokens} tokens, prompts "
          f"{args.prompt_len}, vocab {args.vocab} (logits {mb:.1f} MB per decode step), d={args.hidden}, "
          f"{args.layers} layer(s), fp32, {args.threads} torch thread(s) per process, {args.rounds} rounds")
    per_step = {}
    for name, s in secs.items():
        per_step[name] = statistics.median(s) / (steps[name] / args.rounds) * 1e3
        rounds = " ".join(f"{x:.2f}" for x in s)
        print(f"  {name:>13}: {per_step[name]:.2f} ms per engine step (median of rounds; rounds {rounds} s, "
              f"{steps[name] // args.rounds} steps each)")
    print(f"  pipe / shared buffer: {per_step['pipe'] / per_step['shared buffer']:.2f}x the time per step; "
          "outputs token for token the same")
    return 0


if __name__ == "__main__":
    sys.exit(main())
