"""`tessera-plan`: per-rank memory, step time and MFU of a `tessera-train` config under a layout,
or every layout of a GPU count ranked.

    tessera-plan --config run.yaml [KEY=VALUE ...] --tensor-parallel 8 --pipeline-parallel 4 \\
        --data-parallel 2 --device h100
    tessera-plan --config run.yaml --gpus 64 --device h200 [--top 10]

Nothing is launched and no model is allocated: parameters are counted on a meta-device model,
activations measured on one fake-tensor block (see docs/parallelism.md, *Planner*).
"""

from __future__ import annotations

import argparse
import json
import textwrap

from tessera.common.config import apply_overrides, read_yaml, validate_config
from tessera.common.errors import UserError, run_cli
from tessera.common.layout import ParallelLayout, parse_pipeline_layers, validate_layout
from tessera.common.models.causal_lm.config import ModelConfig
from tessera.trainer.config import TrainConfig
from tessera.trainer.parallel.launch import add_parallel_arguments, parallel_overrides
from tessera.trainer.plan.devices import DEVICES, DeviceSpec, resolve_device
from tessera.trainer.plan.memory import MemoryPlan, memory_count, plan_memory
from tessera.trainer.plan.search import rank_layouts
from tessera.trainer.plan.spec import PRECISIONS, PlanSpec
from tessera.trainer.plan.timing import DEFAULT_EFFICIENCY, TimePlan, plan_time

GIB = 2**30


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tessera-plan",
        description=textwrap.fill(
            "Predict per-rank memory (weights, grads, optimizer state, activations, buffers), step time and MFU "
            "of a tessera-train config under a parallel layout on a device, or rank every layout of --gpus "
            "ranks. The config's data section is optional here; model.vocab_size comes from the config or "
            "else from data.mixture's manifest.", width=100),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example:\n  tessera-plan --config examples/configs/llama-1b.yaml --tensor-parallel 2 --data-parallel 4 "
               "--device h100\n  tessera-plan --config run.yaml --gpus 16 --device h200 --top 5\n\n"
               "exit codes: 0 success, 2 bad config, layout or flag.")
    p.add_argument("--config", required=True, metavar="CONFIG.yaml", help="A tessera-train YAML config.")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="Dotted config overrides, e.g. training.seq_length=8192.")
    add_parallel_arguments(p, defaults=False)
    g = p.add_argument_group("planning")
    g.add_argument("--data-parallel", type=int, default=None, metavar="D",
                   help="Data-parallel size of the planned layout (default: --gpus / (tensor x context x expert x "
                        "pipeline), else 1).")
    g.add_argument("--gpus", type=int, default=None, metavar="N",
                   help="Ranks in all. Without layout flags: rank every valid layout of N ranks.")
    g.add_argument("--top", type=int, default=10, metavar="K", help="With --gpus alone: layouts shown (default 10).")
    g.add_argument("--precision", choices=PRECISIONS, default=None,
                   help="Override training.precision: fp32, bf16 (the trainer's autocast over fp32 weights), "
                        "bf16-master (bf16 parameters, fp32 grads and masters), fp8 (the trainer's: bf16 with "
                        "torchao Float8Linear layers), fp8-master (fp8 over bf16 parameters).")
    g.add_argument("--fp8-all-gather", action="store_true",
                   help="With --precision fp8-master under FSDP: all-gather the blocks' linear weights in float8 "
                        "(torchao's float8 all-gather, torchtitan's enable_fsdp_float8_all_gather).")
    g.add_argument("--recompute", choices=("none", "selective", "full"), default=None,
                   help="Override training.recompute.")
    g.add_argument("--efficiency", type=float, default=DEFAULT_EFFICIENCY, metavar="F",
                   help=f"Fraction of peak FLOP/s the compute reaches (default {DEFAULT_EFFICIENCY}).")
    g.add_argument("--json", action="store_true", help="Print the plan as JSON instead of a table.")
    d = p.add_argument_group("device")
    d.add_argument("--device", default="h100", choices=[*DEVICES, "cpu", "custom"],
                   help="h100, h200, a100 (data-sheet figures), cpu (this machine) or custom (give every figure).")
    for flag, what in (("--memory-gib", "memory per rank, GiB"), ("--peak-tflops", "dense bf16 TFLOP/s"),
                       ("--hbm-gbps", "memory bandwidth, GB/s"), ("--intra-node-gbps", "in-node collective GB/s"),
                       ("--inter-node-gbps", "between-node GB/s per device")):
        d.add_argument(flag, type=float, default=None, help=f"Override the device's {what}.")
    d.add_argument("--devices-per-node", type=int, default=None, help="Devices sharing the fast interconnect.")
    return p


def _load(args: argparse.Namespace) -> tuple[TrainConfig, ModelConfig]:
    data = read_yaml(args.config)
    data.setdefault("data", {"mixture": "-", "tokenizer": "-"})  # not read when planning
    origins: dict[str, str] = {}
    apply_overrides(data, list(args.overrides) + parallel_overrides(args), origins)
    cfg = validate_config(TrainConfig, data, args.config, origins)
    from tessera.common.models.causal_lm.config import PRESETS
    from tessera.common.models.hybrid.config import PRESETS as HYBRID_PRESETS

    presets = HYBRID_PRESETS if cfg.model.get("kind") == "hybrid" else PRESETS
    preset = presets.get(str(cfg.model.get("preset")), {})
    vocab = cfg.model.get("vocab_size", preset.get("vocab_size"))  # a preset's own vocabulary counts
    if vocab is None:
        from tessera.common.mixture import read_mixture_manifest

        try:
            vocab = read_mixture_manifest(cfg.data.mixture).vocab_size
        except (OSError, UserError, ValueError):
            raise UserError(f"{args.config}: model.vocab_size is not set and data.mixture ({cfg.data.mixture}) has no "
                            "readable manifest; set model.vocab_size=N") from None
    try:
        model = cfg.resolve_model(vocab)
    except ValueError as exc:
        raise UserError(f"{args.config}: model: {exc}") from None
    memory_count(model)  # a kind the planner cannot count: refused before any planning
    return cfg, model


def _layout(args: argparse.Namespace, cfg: TrainConfig) -> ParallelLayout:
    p = cfg.parallel
    mp = p.tensor * p.context * p.pipeline * p.expert
    if args.data_parallel is not None and args.data_parallel < 1:
        raise UserError("--data-parallel must be at least 1")
    if args.data_parallel is not None:
        dp = args.data_parallel
    elif args.gpus is not None:
        if args.gpus % mp:
            raise UserError(f"--gpus {args.gpus} is not divisible by tensor x context x expert x pipeline ({mp})")
        dp = args.gpus // mp
    else:
        dp = 1
    if dp % p.data_shard:
        raise UserError(f"--data-shard {p.data_shard} must divide the data-parallel size ({dp})")
    return ParallelLayout(tensor=p.tensor, context=p.context, expert=p.expert, pipeline=p.pipeline,
                          virtual_stages=p.virtual_stages, data=dp, data_shard=p.data_shard,
                          pipeline_layers=p.pipeline_layers)


def _gib(b: float) -> str:
    return f"{b / GIB:.2f}"


def describe(spec: PlanSpec, mem: MemoryPlan, tp: TimePlan, device: DeviceSpec) -> dict:
    world = spec.layout.world_size
    return dict(layout=spec.layout.short(), world=world, precision=spec.precision, recompute=spec.recompute,
                memory_gib={k: v / GIB if k != "pp_rank" else v for k, v in mem.as_dict().items()},
                fits=mem.peak <= device.memory_bytes, device=device.name, device_memory_gib=device.memory_gib,
                step_s=tp.step_s, compute_s=tp.compute_s, bubble_s=tp.bubble_s, exposed_comm_s=tp.exposed_comm_s,
                comm_s=tp.comm, tokens_per_s=tp.tokens_per_s(), mfu=tp.mfu(world, device.peak_tflops),
                notes=mem.notes)


def _print_one(spec: PlanSpec, mem: MemoryPlan, tp: TimePlan, device: DeviceSpec) -> None:
    d = describe(spec, mem, tp, device)
    print(f"model: {spec.model.num_params() / 1e9:.3f} B parameters, {spec.model.num_layers} layers; seq {spec.seq_len}, "
          f"micro-batch {spec.micro_batch}, global batch {spec.global_batch} ({spec.num_microbatches} micro-batches "
          f"per rank); {spec.precision}, recompute {spec.recompute}")
    print(f"layout: {d['layout']} ({d['world']} ranks); device: {device.name}, {device.memory_gib:.1f} GiB")
    print(f"per-rank memory (pipeline rank {mem.pp_rank}, the largest), GiB:")
    for key in ("weights", "grads", "optimizer", "activations", "buffers", "optimizer_temp", "init"):
        print(f"  {key:<15} {_gib(getattr(mem, key))}")
    print(f"  {'peak':<15} {_gib(mem.peak)}  ({'fits' if d['fits'] else 'does NOT fit'} in {device.memory_gib:.1f})")
    print(f"step: {tp.step_s:.3f} s (compute {tp.compute_s:.3f}, bubble {tp.bubble_s:.3f}, exposed communication "
          f"{tp.exposed_comm_s:.3f}); {d['tokens_per_s']:,.0f} tokens/s; MFU {d['mfu']:.1%}")
    for kind, s in tp.comm.items():
        print(f"  {kind:<22} {s:.3f} s")
    for note in mem.notes:
        print(f"note: {note}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cfg, model = _load(args)
    device = resolve_device(args.device, memory_gib=args.memory_gib, peak_tflops=args.peak_tflops,
                            hbm_gbps=args.hbm_gbps, intra_node_gbps=args.intra_node_gbps,
                            inter_node_gbps=args.inter_node_gbps, devices_per_node=args.devices_per_node)
    if not 0 < args.efficiency <= 1:
        raise UserError(f"--efficiency {args.efficiency}: must be in (0, 1]")
    layout_given = any(v is not None for v in (args.tensor_parallel, args.context_parallel, args.expert_parallel,
                                               args.pipeline_parallel, args.virtual_stages, args.data_shard,
                                               args.data_parallel)) \
        or parse_pipeline_layers(args.pipeline_layers) is not None
    layout = _layout(args, cfg)
    spec = PlanSpec.from_train_config(cfg, model, layout, args.precision, args.recompute)
    if args.device == "cpu":
        spec = spec.model_copy(update={"device_type": "cpu"})
    if args.fp8_all_gather:
        searching = args.gpus is not None and not layout_given  # the search keeps only layouts it composes with
        if spec.precision != "fp8-master" or not (spec.fsdp or searching):
            raise UserError("--fp8-all-gather needs --precision fp8-master and --data-shard > 1 (float8 all-gather "
                            f"of FSDP's bf16 parameters); this plan is {spec.precision} with data_shard "
                            f"{spec.layout.data_shard}")
        if layout.tensor > 1 and not searching:
            raise UserError(f"--fp8-all-gather does not compose with --tensor-parallel {layout.tensor} (torchao's float8 "
                            "weights are for Float8Linear, not Tessera's tensor-parallel layers); set it to 1")
        spec = spec.model_copy(update={"fp8_all_gather": True})
    if args.gpus is not None and not layout_given:
        ranked = rank_layouts(spec, args.gpus, device, args.efficiency)
        if not ranked:
            raise UserError(f"no layout of {args.gpus} ranks fits this model and batch (global batch "
                            f"{spec.global_batch}, micro-batch {spec.micro_batch}); change --gpus or the batch")
        rows = [describe(c.spec, c.memory, c.time, device) for c in ranked[:args.top]]
        if args.json:
            print(json.dumps(rows, indent=1))
            return 0
        print(f"{len(ranked)} valid layouts of {args.gpus} ranks on {device.name}; fastest that fit first")
        print(f"{'layout':<26} {'peak GiB':>9} {'fits':>5} {'step s':>9} {'tokens/s':>12} {'MFU':>6}")
        for r in rows:
            print(f"{r['layout']:<26} {r['memory_gib']['peak']:>9.2f} {'yes' if r['fits'] else 'no':>5} "
                  f"{r['step_s']:>9.3f} {r['tokens_per_s']:>12,.0f} {r['mfu']:>6.1%}")
        return 0
    validate_layout(model, layout, world_size=args.gpus, seq_len=spec.seq_len, global_batch=spec.global_batch,
                    micro_batch=spec.micro_batch, sequence_parallel=spec.sequence_parallel)
    mem, tp = plan_memory(spec), plan_time(spec, device, args.efficiency)
    if args.json:
        print(json.dumps(describe(spec, mem, tp, device), indent=1))
    else:
        _print_one(spec, mem, tp, device)
    return 0


def entry() -> None:
    run_cli(main)


if __name__ == "__main__":
    entry()
