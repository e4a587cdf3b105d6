"""Command-line flags and process-group set-up for parallel launches.

    torchrun --nnodes N --nproc-per-node G --rdzv-backend c10d --rdzv-endpoint HOST:PORT \\
        -m tessera.trainer --config run.yaml --tensor-parallel 2 --pipeline-parallel 2 --virtual-stages 2

Data parallel is implied: world size / (tensor x context x expert x pipeline). The trainer CLI adds these flags with
`add_parallel_arguments`, turns them into a layout with `layout_from_args` (validating before
any work), and joins the job with `setup_parallel`.
"""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING

from tessera.common.errors import UserError
from tessera.common.layout import ParallelLayout, parse_pipeline_layers

if TYPE_CHECKING:  # torch.distributed is imported only when a job is joined (keeps `--help` fast)
    from tessera.common.parallel.state import ParallelGroups


def add_parallel_arguments(parser: argparse.ArgumentParser, defaults: bool = True) -> None:
    """The layout flags. With `defaults=False` every flag defaults to None (unset), so a caller
    that also reads the layout from a config file can tell given flags apart (see
    `parallel_overrides`)."""
    one = 1 if defaults else None
    title = "parallelism (data parallel = world size / (tensor x context x expert x pipeline))"
    if not defaults:
        title += "; each flag overrides the config's parallel.* key of the same name"
    g = parser.add_argument_group(title)
    g.add_argument("--tensor-parallel", type=int, default=one, metavar="N",
                   help="Tensor-parallel size: must divide heads, kv heads, ffn size and vocab (default 1).")
    g.add_argument("--context-parallel", type=int, default=one, metavar="C",
                   help="Context-parallel size: the sequence split into 2C chunks, rank i holding chunks i and "
                        "2C-1-i, attention over all-gathered keys/values; 2C must divide the sequence (default 1).")
    g.add_argument("--expert-parallel", type=int, default=one, metavar="E",
                   help="Expert-parallel size: each MoE layer's experts split over E ranks, tokens sent to their "
                        "expert's rank and back (all-to-all); E must divide model.moe.num_experts. Expert ranks read "
                        "their own rows of the batch, as data ranks do (default 1).")
    g.add_argument("--pipeline-parallel", type=int, default=one, metavar="N",
                   help="Pipeline stages across ranks; 1F1B schedule (default 1).")
    g.add_argument("--virtual-stages", type=int, default=one, metavar="V",
                   help="Model chunks per pipeline rank; above 1 uses interleaved 1F1B (default 1).")
    g.add_argument("--pipeline-layers", default=None, metavar="L1,L2,...",
                   help="Layers per stage in stage order (pipeline x virtual-stages values), e.g. 5,4,4,3; "
                        "automatic when omitted.")
    g.add_argument("--data-shard", type=int, default=one, metavar="N",
                   help="Fully sharded data parallel: shard parameters, gradients and optimizer state over N "
                        "data-parallel ranks (FSDP2); N must divide the data-parallel size, the quotient being "
                        "HSDP replicas (default 1: off).")
    g.add_argument("--no-sequence-parallel", dest="sequence_parallel", action="store_false",
                   default=True if defaults else None,
                   help="Keep norms/dropout replicated across tensor ranks (default: sequence parallel on).")
    g.add_argument("--no-distributed-optimizer", dest="distributed_optimizer", action="store_false",
                   default=True if defaults else None,
                   help="Keep full optimizer state on every data-parallel rank (default: ZeRO-1 sharding).")


def parallel_overrides(args: argparse.Namespace, section: str = "parallel") -> list[str]:
    """Dotted config overrides (`parallel.tensor=2`, ...) for the flags that were given."""
    out = []
    for flag, key in (("tensor_parallel", "tensor"), ("context_parallel", "context"), ("expert_parallel", "expert"),
                      ("pipeline_parallel", "pipeline"),
                      ("virtual_stages", "virtual_stages"), ("data_shard", "data_shard"),
                      ("sequence_parallel", "sequence_parallel"),
                      ("distributed_optimizer", "distributed_optimizer")):
        value = getattr(args, flag)
        if value is not None:
            out.append(f"{section}.{key}={str(value).lower() if isinstance(value, bool) else value}")
    if args.pipeline_layers is not None:
        counts = parse_pipeline_layers(args.pipeline_layers)
        out.append(f"{section}.pipeline_layers={'null' if counts is None else counts}")
    return out


def layout_from_args(args: argparse.Namespace, world_size: int | None = None) -> ParallelLayout:
    """The layout the flags ask for on `world_size` processes (default: torchrun's WORLD_SIZE)."""
    world = world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", "1"))
    tp, pp, v, ds = args.tensor_parallel, args.pipeline_parallel, args.virtual_stages, args.data_shard
    cp = getattr(args, "context_parallel", 1) or 1
    ep = getattr(args, "expert_parallel", 1) or 1
    for flag, value in (("--tensor-parallel", tp), ("--context-parallel", cp), ("--expert-parallel", ep),
                        ("--pipeline-parallel", pp),
                        ("--virtual-stages", v), ("--data-shard", ds)):
        if value < 1:
            raise UserError(f"{flag} must be at least 1, got {value}")
    model = tp * cp * ep * pp
    if world % model:
        raise UserError(f"world size {world} is not divisible by --tensor-parallel {tp} x --context-parallel {cp} x "
                        f"--expert-parallel {ep} x --pipeline-parallel {pp}; launch a multiple of tensor x context x "
                        "expert x pipeline processes")
    if (world // model) % ds:
        raise UserError(f"--data-shard {ds} must divide the data-parallel size {world // model} (world size "
                        f"{world} / (tensor x context x expert x pipeline)); the quotient is the number of HSDP "
                        "replicas")
    return ParallelLayout(tensor=tp, context=cp, expert=ep, pipeline=pp, virtual_stages=v, data=world // model, data_shard=ds,
                          pipeline_layers=parse_pipeline_layers(args.pipeline_layers))


def setup_parallel(layout: ParallelLayout) -> ParallelGroups:
    """Join the torchrun job (or a one-process group), build and register the groups."""
    from tessera.common.parallel.state import build_groups, init_distributed, set_groups

    device = init_distributed()
    groups = build_groups(layout, device)
    set_groups(groups)
    return groups
