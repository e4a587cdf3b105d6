"""`tessera-train`: train a model from a mixture artifact, as configured by a YAML file.

    tessera-train --config CONFIG.yaml [dotted.key=value ...] [--resume] [--compile] [--quiet]
    torchrun --nproc-per-node N -m tessera.trainer --config CONFIG.yaml [--tensor-parallel T]
        [--pipeline-parallel P] [--virtual-stages V] [--pipeline-layers L1,L2,...] ...
"""

from __future__ import annotations

import argparse
import os
import textwrap

from tessera.common.config import describe_fields, load_config
from tessera.common.errors import out_of_memory, run_cli
from tessera.common.fileio import ensure_output_dir
from tessera.common.models.causal_lm.config import ModelConfig
from tessera.trainer.config import TrainConfig
from tessera.trainer.parallel.launch import add_parallel_arguments, parallel_overrides


def _config_reference() -> str:
    rows = []
    for name, default, description in describe_fields(TrainConfig):
        rows.append((name, default, description))
        if name == "model":  # the model section is a ModelConfig (plus `preset`): list its fields too
            rows.extend((f"model.{n}", d, desc) for n, d, desc in describe_fields(ModelConfig))
    lines = ["config keys (YAML sections; override any with KEY=VALUE):"]
    for name, default, description in rows:
        lines.append(f"  {name}" + (f" = {default}" if default else ""))
        lines.extend(textwrap.wrap(description, width=96, initial_indent="      ", subsequent_indent="      "))
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tessera-train",
        description=textwrap.fill(
            "Train a GPT/Llama-family decoder from a mixture artifact (built by `tessera-data blend`). "
            "Logs loss, grad norm, lr, tokens/s, TFLOP/s, MFU and memory per step (console, "
            "<run_dir>/metrics.jsonl, TensorBoard), saves DCP checkpoints under <run_dir>/checkpoints, "
            "and stops cleanly (save, exit 0) on SIGTERM/SIGINT. Launch with torchrun for several processes.",
            width=100),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=_config_reference() + "\n\nexample:\n  tessera-train --config examples/configs/tiny.yaml "
               "training.steps=50 optim.lr=1e-3\n"
               "  torchrun --nproc-per-node 4 -m tessera.trainer --config run.yaml --tensor-parallel 2 "
               "--pipeline-parallel 2\n\nexit codes: 0 success, 2 bad config/input, 1 other failure.",
    )
    parser.add_argument("--config", required=True, metavar="CONFIG.yaml", help="YAML file with the run's TrainConfig.")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="Dotted overrides applied on top of the file, e.g. training.steps=20 model.num_layers=4.")
    parser.add_argument("--resume", action="store_true",
                        help="Continue from the checkpoint the pointer in the checkpoint directory names "
                             "(starts fresh, saying so, when there is none yet). Implied in a job torchrun "
                             "restarted (--max-restarts).")
    parser.add_argument("--compile", action="store_true", help="torch.compile the step (= training.compile=true; what is one graph: training.compile_scope).")
    parser.add_argument("--eval-only", action="store_true",
                        help="Evaluate the model on the valid and test splits and exit; train and save nothing "
                             "(= training.eval_only=true). Combine with --resume or checkpoint.init_from=CKPT.")
    parser.add_argument("--peak-tflops", type=float, default=None, metavar="TFLOPS",
                        help="Peak TFLOP/s for MFU (= training.peak_tflops); default: known-GPU table, or a measured CPU matmul.")
    parser.add_argument("--quiet", action="store_true", help="No progress bar.")
    add_parallel_arguments(parser, defaults=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_intermixed_args(argv)  # overrides may come before or after flags
    overrides = list(args.overrides)
    if args.compile:
        overrides.append("training.compile=true")
    if args.eval_only:
        overrides.append("training.eval_only=true")
    if args.peak_tflops is not None:
        overrides.append(f"training.peak_tflops={args.peak_tflops}")
    overrides.extend(parallel_overrides(args))  # flags win over the config's parallel section
    cfg = load_config(TrainConfig, args.config, overrides)  # a non-UTF-8 file is a UserError (read_yaml)

    # Heavy imports after argument validation keeps `--help` and bad-usage errors fast.
    from tessera.trainer.components.checkpoint.storage import latest_checkpoint
    from tessera.trainer.components.distributed import (
        finish_runtime,
        init_runtime,
        select_device,
        shutdown_runtime,
    )
    from tessera.trainer.components.observability.out_of_memory import out_of_memory_error
    from tessera.trainer.inputs import check_inputs
    from tessera.trainer.trainer import Trainer

    # torchrun --max-restarts re-runs this same command after a rank died: the restarted attempt
    # continues from the newest checkpoint (Megatron and torchtitan resume the same way).
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    resume = args.resume or restart > 0
    # Every rank checks the config before it joins the process group (torchrun's WORLD_SIZE): a refused
    # one exits with its one line before any peer connects, instead of leaving a peer that was still
    # connecting to fail with gloo's traceback (or to wait for it until the group's timeout).
    select_device(cfg.training.device)  # first: a CUDA check must not open a context on GPU 0 per rank
    inputs = check_inputs(cfg, int(os.environ.get("WORLD_SIZE", "1")), resume=resume)
    runtime = init_runtime(cfg.training.device)
    try:
        if restart and runtime.is_main:
            print(f"torchrun restart {restart}: resuming from "
                  f"{inputs.resume_from or 'step 0 (no checkpoint yet)'}", flush=True)
        _check_output_dirs(cfg)
        if args.resume and inputs.resume_from is None and runtime.is_main:
            print(f"--resume: no checkpoint in {cfg.checkpoint_dir} yet; starting from step 0", flush=True)
        try:
            trainer = Trainer(cfg, inputs, runtime, quiet=args.quiet)
        except BaseException as exc:  # building the model and optimizer: out of memory is one line too
            oom = out_of_memory(exc)
            if oom is None:
                raise
            raise out_of_memory_error(oom, cfg, inputs.layout, "setting up the model", 0, runtime.rank,
                                      runtime.is_main, runtime.device, latest_checkpoint(cfg.checkpoint_dir)) from None
        trainer.train()
        finish_runtime()
    finally:
        shutdown_runtime()
    return 0


def _check_output_dirs(cfg: TrainConfig) -> None:
    """The run and checkpoint folders must be creatable: one line naming the field, not a traceback later."""
    outputs = [("run_dir", cfg.run_dir)]
    if not cfg.training.eval_only:  # an evaluation saves no checkpoint
        outputs.append(("checkpoint.dir", cfg.checkpoint_dir))
    if cfg.profiling.start_step is not None:
        outputs.append(("profiling.dir", cfg.profile_dir))
    for field, path in outputs:
        ensure_output_dir(path, field)


def entry() -> None:
    run_cli(main)


if __name__ == "__main__":
    entry()
