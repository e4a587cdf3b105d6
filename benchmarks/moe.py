"""Mixture-of-experts training throughput: Tessera vs transformers' Qwen3-MoE (or Mixtral) of the
same shape, same run; on CUDA also the experts' grouped GEMM vs a loop over experts.

Both frameworks train the same model: Tessera's is built from a preset (`qwen3-moe-tiny` or
`mixtral-tiny`, resized by the flags), transformers' from the config.json Tessera would export
for it (tessera.common.models.causal_lm.hf.adapter.hf_config), its weights copied through the one HF adapter's export
rules, so names, shapes and the routing (softmax top-k, normalised weights) are the same. The
step is the one benchmarks/train_throughput.py times for dense models: Tessera's trainer step
(TrainStep: forward + loss, clip, fused AdamW; compiled unless --no-compile) vs the standard
transformers loop; steps alternate in one process (machine load hits both alike). The aux loss
is off for both (transformers adds it only when asked for router logits; Tessera's enters through
the gradient), so both optimise the same loss and "loss after" must agree.

Experts: Tessera sorts each token's assignments by expert and runs each expert on its
contiguous slice (one `torch._grouped_mm` per projection on sm90+ in bf16, a loop over experts
elsewhere); transformers loops over the experts hit, gathering each one's tokens. `--experts-only`
(CUDA) times just that: one MoE layer's expert computation, forward + backward, grouped GEMM vs
the loop, on the same sorted tokens.

    python benchmarks/moe.py                                   # CPU-sized defaults
    python benchmarks/moe.py --family mixtral --experts 8 --top-k 2
    python benchmarks/moe.py --device cuda --precision bf16 --hidden 1024 --expert-ffn 512 --experts 64 --top-k 8
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from train_throughput import hf_standard_step, tessera_step, time_interleaved  # noqa: E402

from tessera.common.layers.moe import Experts  # noqa: E402
from tessera.common.models.causal_lm.config import ModelConfig, preset  # noqa: E402
from tessera.common.models.causal_lm.hf.adapter import export_rules, hf_config  # noqa: E402
from tessera.trainer.components.model_setup import prepare_model  # noqa: E402
from tessera.trainer.components.precision.mixed import Precision  # noqa: E402
from tessera.trainer.config import OptimConfig  # noqa: E402

PRESETS = {"qwen3_moe": "qwen3-moe-tiny", "mixtral": "mixtral-tiny"}


def model_config(args: argparse.Namespace) -> ModelConfig:
    base = preset(PRESETS[args.family])
    moe = base.moe.model_copy(update={"num_experts": args.experts, "top_k": args.top_k,
                                      "ffn_hidden_size": args.expert_ffn, "aux_loss_coef": 0.0})
    # Mixtral's experts are as wide as its (unused) dense MLP: intermediate_size is both.
    dense = {"ffn_hidden_size": args.expert_ffn} if args.family == "mixtral" else {}
    return preset(PRESETS[args.family], hidden_size=args.hidden, num_layers=args.layers, num_heads=args.heads,
                  num_kv_heads=args.kv_heads, vocab_size=args.vocab, max_seq_len=max(args.seq, 64),
                  moe=moe.model_dump(), **dense)


def hf_model(cfg: ModelConfig, ours: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """transformers' model of `cfg`'s family with Tessera's weights, loaded the way a user loads an
    export: config.json + model.safetensors (the adapter's names, one tensor per expert) through
    `from_pretrained`, which converts them to its in-memory layout (fused experts in transformers 5)."""
    import transformers
    from safetensors.torch import save_file

    src = dict(ours.named_parameters())
    tensors = {r.target: r.apply([src[s].detach() for s in r.sources]).contiguous() for r in export_rules(cfg)}
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(hf_config(cfg, torch.float32, None, None)))
        save_file(tensors, str(Path(tmp) / "model.safetensors"))
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32, attn_implementation="sdpa")
    hf.to(device).train()
    return hf


def experts_only(cfg: ModelConfig, args: argparse.Namespace, device: torch.device) -> dict[str, float]:
    """One MoE layer's experts, forward + backward on the same sorted tokens: grouped GEMM vs loop
    (median ms). The grouped path needs sm90+ and bf16 (Experts' own rule)."""
    moe = cfg.moe
    assert moe is not None
    experts = Experts(moe.num_experts, cfg.hidden_size, moe.ffn_hidden_size).to(device, torch.bfloat16)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0.0, 0.02)
    n = args.batch * args.seq * moe.top_k
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, moe.num_experts, (n,), generator=gen).sort().values
    counts = torch.bincount(ids, minlength=moe.num_experts).tolist()
    x = torch.randn(n, cfg.hidden_size, generator=gen).to(device, torch.bfloat16).requires_grad_()
    out = {}
    # Experts.forward asks tessera.common.layers.moe._grouped_mm_ok which path to take: force the loop.
    import tessera.common.layers.moe as moe_module

    original = moe_module._grouped_mm_ok
    if not original(x):
        print("note: this device/dtype has no grouped GEMM (sm90+, bf16): both rows time the loop")
    for name, grouped in (("grouped_mm", True), ("loop", False)):
        moe_module._grouped_mm_ok = original if grouped else (lambda _t: False)
        try:
            times = []
            for i in range(args.warmup + args.steps):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                experts(x, counts).float().pow(2).mean().backward()
                torch.cuda.synchronize()
                if i >= args.warmup:
                    times.append((time.perf_counter() - t0) * 1e3)
            out[name] = statistics.median(times)
        finally:
            moe_module._grouped_mm_ok = original
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", choices=sorted(PRESETS), default="qwen3_moe",
                    help="transformers peer: Qwen3MoeForCausalLM or MixtralForCausalLM (default qwen3_moe).")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--expert-ffn", type=int, default=256, help="Each expert's ffn size.")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10, help="Timed steps per framework.")
    ap.add_argument("--warmup", type=int, default=3, help="Untimed steps first (the first includes compilation).")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--no-compile", action="store_true", help="Run Tessera eager.")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--experts-only", action="store_true", help="CUDA: also time grouped GEMM vs loop over experts.")
    ap.add_argument("--json", default=None, help="Also write the figures to this JSON file.")
    args = ap.parse_args()
    if args.experts_only and args.device == "cpu":
        ap.error("--experts-only compares the CUDA grouped GEMM with the loop; use --device cuda")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    cfg = model_config(args)
    optim_cfg = OptimConfig(lr=3e-4, weight_decay=0.1, grad_clip=1.0)
    gen = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(4):
        tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=gen)
        batches.append((tokens[:, :-1].contiguous().to(device), tokens[:, 1:].contiguous().to(device)))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    ours = prepare_model(cfg, device, seed=0)
    hf = hf_model(cfg, ours, device)
    with torch.no_grad():  # the same model: same logits before any step
        ours.eval()
        hf.eval()
        a, b = ours(batches[0][0]), hf(input_ids=batches[0][0]).logits
        ours.train()
        hf.train()
    print(f"same model check: max |logits difference| {float((a - b).abs().max()):.2e} "
          f"(logits up to {float(b.abs().max()):.2f})")
    precision = Precision(args.precision, device)
    step_fns = {"transformers": hf_standard_step(hf, optim_cfg, precision),
                "tessera": tessera_step(ours, optim_cfg, precision, not args.no_compile)}
    results = time_interleaved(step_fns, batches, args.warmup, args.steps, sync)
    tokens_per_step = args.batch * args.seq
    for r in results.values():
        r["median_step_s"] = statistics.median(r["step_times_s"])
        r["tokens_per_s"] = tokens_per_step / r["median_step_s"]
    moe = cfg.moe
    assert moe is not None
    print(f"model: {cfg.arch} {cfg.num_params() / 1e6:.1f}M params (d={cfg.hidden_size}, L={cfg.num_layers}, "
          f"{moe.num_experts} experts top-{moe.top_k} of ffn {moe.ffn_hidden_size}, first {moe.first_k_dense} "
          f"dense, V={cfg.vocab_size}); batch {args.batch} x seq {args.seq}; {args.precision}; threads "
          f"{torch.get_num_threads()}; device {device}; tessera compile={'off' if args.no_compile else 'on'}")
    print(f"{'':14}{'tokens/s':>12}{'median step':>14}{'first step':>13}{'loss after':>12}")
    for name, r in results.items():
        print(f"{name:14}{r['tokens_per_s']:>12,.0f}{r['median_step_s'] * 1e3:>11.1f} ms"
              f"{r['first_step_s']:>11.1f} s{r['final_loss']:>12.4f}")
    ratio = results["tessera"]["tokens_per_s"] / results["transformers"]["tokens_per_s"]
    print(f"ratio tessera/transformers: {ratio:.2f}x")
    grouped = None
    if args.experts_only:
        grouped = experts_only(cfg, args, device)
        print(f"experts of one layer, forward + backward, bf16: grouped GEMM {grouped['grouped_mm']:.2f} ms, "
              f"loop over experts {grouped['loop']:.2f} ms ({grouped['loop'] / grouped['grouped_mm']:.2f}x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "machine": platform.platform(), "torch": torch.__version__,
                       "results": results, "ratio": ratio, "experts_only_ms": grouped}, f, indent=2)


if __name__ == "__main__":
    main()
