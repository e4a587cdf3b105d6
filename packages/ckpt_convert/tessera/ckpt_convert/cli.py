"""`tessera-ckpt`: reshard, export, import, verify and describe Tessera checkpoints.

Every verb validates its arguments and inputs before writing anything, writes its output under a
temporary name renamed into place when complete, and exits 0 on success, 2 on bad input (one
line on stderr), 1 on anything else.
"""

from __future__ import annotations

import argparse
import sys

from tessera.ckpt_convert.options import DTYPE_CHOICES, NO_SYNC_HELP, parse_dtype, parse_size
from tessera.common.errors import UserError, run_cli

CKPT_HELP = ("checkpoint: an iteration directory (iter_NNNNNNN/), a checkpoints directory with "
             "latest_checkpointed_iteration.txt, or a run directory containing checkpoints/")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # usage errors: one line, exit 2 (via UserError)
        raise UserError(f"{message} (see {self.prog} --help)")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="tessera-ckpt", description=__doc__.split("\n\n")[0],
                formatter_class=argparse.RawDescriptionHelpFormatter,
                epilog="Formats: docs/formats/checkpoint.md, docs/formats/exports.md. CLI: docs/cli/tessera-ckpt.md")
    sub = p.add_subparsers(dest="verb", metavar="VERB", required=True, parser_class=_Parser)

    def common(sp: argparse.ArgumentParser, overwrite: bool = True) -> None:
        if overwrite:  # the verbs that write an output
            sp.add_argument("--overwrite", action="store_true",
                            help="replace OUTPUT if it exists (the old one is removed only after the new one is complete)")
            sp.add_argument("--no-sync", dest="sync", action="store_false", help=NO_SYNC_HELP)
        sp.add_argument("--quiet", action="store_true", help="no progress bar")

    r = sub.add_parser("reshard", help="rewrite a checkpoint partitioned for another parallel layout",
                       description="Rewrite a checkpoint so that its DCP payload has one file per rank of the target "
                                   "layout, each holding that rank's slices (model and optimizer state). Offline, one "
                                   "process, tensor by tensor. OUTPUT becomes a checkpoints directory (iter_NNNNNNN/ + "
                                   "latest_checkpointed_iteration.txt) that the trainer resumes from.")
    r.add_argument("--checkpoint", required=True, help=CKPT_HELP)
    r.add_argument("--output", required=True, help="new checkpoints directory to create")
    r.add_argument("--tensor-parallel", type=int, required=True, metavar="T", help="target tensor-parallel size")
    r.add_argument("--pipeline-parallel", type=int, required=True, metavar="P", help="target pipeline-parallel size")
    r.add_argument("--data-parallel", type=int, default=1, metavar="D",
                   help="target data-parallel size (optimizer state is split across it; default 1)")
    r.add_argument("--expert-parallel", type=int, default=1, metavar="E",
                   help="target expert-parallel size: each MoE layer's experts split over E ranks; must divide "
                        "model.moe.num_experts (default 1)")
    r.add_argument("--virtual-stages", type=int, default=1, metavar="V",
                   help="model chunks per pipeline rank, interleaved schedule (default 1)")
    r.add_argument("--pipeline-layers", default=None, metavar="L1,L2,...",
                   help="layers per pipeline stage in stage order (pipeline x virtual-stages values), as the trainer's "
                        "--pipeline-layers, e.g. 1,2,1; default: the trainer's automatic split (as even as possible, "
                        "extra layers to the middle stages)")
    common(r)

    e = sub.add_parser("export", help="export to Hugging Face (hf), TensorRT-LLM (trtllm) or Megatron-Core (megatron)",
                       description="hf: a transformers directory (safetensors, config.json, generation_config.json, "
                                   "tokenizer) of the model's class: LlamaForCausalLM, GPT2LMHeadModel, ..., "
                                   "NemotronHForCausalLM, Mamba2ForCausalLM. trtllm: a TensorRT-LLM checkpoint "
                                   "(config.json + rank{R}.safetensors) for trtllm-build (causal LMs only). megatron: "
                                   "a Megatron-Core torch_dist checkpoint (GPTModel; MambaModel for hybrid models; "
                                   "BertModel for pre-LayerNorm encoders).")
    e.add_argument("--format", required=True, choices=("hf", "trtllm", "megatron"),
                   help="output format (megatron: a Megatron-Core torch_dist checkpoint)")
    e.add_argument("--checkpoint", required=True, help=CKPT_HELP)
    e.add_argument("--output", required=True, help="output directory to create")
    e.add_argument("--dtype", choices=DTYPE_CHOICES, default=None,
                   help="weight dtype of the export (default: as stored)")
    e.add_argument("--max-shard-size", default="5GB",
                   help="hf: largest safetensors file before splitting into shards with an index (default 5GB)")
    e.add_argument("--tensor-parallel", type=int, default=1, metavar="T",
                   help="trtllm: tensor-parallel size; megatron: the size whose vocabulary padding the export gets "
                        "(default 1)")
    e.add_argument("--pipeline-parallel", type=int, default=1, metavar="P", help="trtllm: pipeline-parallel size (default 1)")
    common(e)

    i = sub.add_parser("import", help="import a Hugging Face directory or a Megatron-Core checkpoint",
                       description="Convert a transformers directory (LlamaForCausalLM, GPT2LMHeadModel, ..., "
                                   "NemotronHForCausalLM, Mamba2ForCausalLM; model.safetensors or sharded with "
                                   "model.safetensors.index.json), or a Megatron-Core torch_dist checkpoint (GPTModel, "
                                   "MambaModel with a hybrid --model-config, or BertModel with a pre-LayerNorm encoder "
                                   "one), into a Tessera checkpoint: OUTPUT becomes "
                                   "a checkpoints directory (iter_0000000/ + pointer) with sidecar and tokenizer.")
    i.add_argument("--format", required=True, choices=("hf", "megatron", "hf-llava-parts"),
                   help="input format: hf, megatron (a Megatron-Core torch_dist checkpoint directory), or "
                        "hf-llava-parts (a new LLaVA from --vision and --language HF directories, projector fresh)")
    i.add_argument("--input", help="Hugging Face model directory, or Megatron iter_NNNNNNN directory")
    i.add_argument("--vision", metavar="DIR", help="hf-llava-parts: CLIPVisionModel / SiglipVisionModel directory")
    i.add_argument("--language", metavar="DIR", help="hf-llava-parts: causal-LM directory with its tokenizer")
    i.add_argument("--image-token", default="<image>", help="hf-llava-parts: the tokenizer's image placeholder token")
    i.add_argument("--vision-feature-layer", type=int, default=-2,
                   help="hf-llava-parts: the tower block whose states the projector reads (LLaVA's -2)")
    i.add_argument("--seed", type=int, default=0, help="hf-llava-parts: seed of the projector's init")
    i.add_argument("--model-config", metavar="FILE",
                   help="megatron: the model as a Tessera model config (YAML/JSON; `kind: hybrid` for a MambaModel "
                        "checkpoint, `kind: encoder` with `norm_placement: pre` for a BertModel one; a torch_dist "
                        "checkpoint holds none that can be read without unpickling)")
    i.add_argument("--tokenizer", metavar="DIR", help="megatron: tokenizer directory to store with the checkpoint")
    i.add_argument("--output", required=True, help="new checkpoints directory to create")
    i.add_argument("--dtype", choices=DTYPE_CHOICES, default=None, help="stored dtype (default: as in the input)")
    i.add_argument("--vocab-size-divisible-by", type=int, default=None, metavar="N",
                   help="causal LMs: pad the embedding and head rows with zeros to a multiple of N (Megatron's "
                        "--make-vocab-size-divisible-by; the padded rows' logits are -inf, exports cut them off; "
                        "`reshard` re-pads to N x its tensor-parallel size when needed; default 128, 1 = no padding). "
                        "Hybrid models are never padded")
    common(i)

    v = sub.add_parser("verify", help="check a checkpoint's integrity",
                       description="Check checksums of every payload file, that every tensor the model config needs is "
                                   "present with the right shape and no unknown model tensor is, and that every tensor reads.")
    v.add_argument("checkpoint", help=CKPT_HELP)
    v.add_argument("--no-read", action="store_true", help="skip reading every tensor (checksums and index only)")
    common(v, overwrite=False)

    n = sub.add_parser("info", help="summarise a checkpoint",
                       description="Print model, parameter count, parallel layout, step, tokens seen and size on disk.")
    n.add_argument("checkpoint", help=CKPT_HELP)
    n.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    return p


def _positive(name: str, value: int, most: int | None = None) -> int:
    if value < 1:
        raise UserError(f"{name} {value}: must be a positive integer")
    if most is not None and value > most:
        raise UserError(f"{name} {value}: must be at most {most}")
    return value


def run(argv: list[str] | None = None) -> int:
    """The CLI body; raises UserError for bad input (tests call this directly)."""
    args = build_parser().parse_args(argv)
    if args.verb == "export" and args.format == "hf":
        from tessera.ckpt_convert.exporters.hf import ExportOptions, export_hf

        if args.tensor_parallel != 1 or args.pipeline_parallel != 1:
            raise UserError("--tensor-parallel/--pipeline-parallel apply to --format trtllm only; "
                            "a Hugging Face export is always unpartitioned")
        out = export_hf(args.checkpoint, args.output, ExportOptions(
            dtype=parse_dtype(args.dtype), max_shard_size=parse_size(args.max_shard_size),
            overwrite=args.overwrite, quiet=args.quiet, sync=args.sync))
        print(out)
    elif args.verb == "export" and args.format == "megatron":
        from tessera.ckpt_convert.exporters.megatron import export_megatron

        if args.pipeline_parallel != 1:
            raise UserError("--pipeline-parallel: a torch_dist checkpoint holds global tensors that load at any "
                            "pipeline size; drop the flag")
        out = export_megatron(args.checkpoint, args.output, tp=_positive("--tensor-parallel", args.tensor_parallel),
                              dtype=parse_dtype(args.dtype), overwrite=args.overwrite, quiet=args.quiet, sync=args.sync)
        print(out)
    elif args.verb == "export":
        from tessera.ckpt_convert.exporters.trtllm import TrtllmOptions, export_trtllm

        out = export_trtllm(args.checkpoint, args.output, TrtllmOptions(
            tp=_positive("--tensor-parallel", args.tensor_parallel),
            pp=_positive("--pipeline-parallel", args.pipeline_parallel),
            dtype=parse_dtype(args.dtype), overwrite=args.overwrite, quiet=args.quiet, sync=args.sync))
        print(out)
    elif args.verb == "reshard":
        from tessera.ckpt_convert.reshard import reshard
        from tessera.common.layout import ParallelLayout, parse_pipeline_layers

        layout = ParallelLayout(tensor=_positive("--tensor-parallel", args.tensor_parallel),
                                pipeline=_positive("--pipeline-parallel", args.pipeline_parallel),
                                data=_positive("--data-parallel", args.data_parallel),
                                expert=_positive("--expert-parallel", args.expert_parallel),
                                virtual_stages=_positive("--virtual-stages", args.virtual_stages),
                                pipeline_layers=parse_pipeline_layers(args.pipeline_layers))
        out = reshard(args.checkpoint, args.output, layout, overwrite=args.overwrite, quiet=args.quiet,
                      sync=args.sync)
        print(out)
    elif args.verb == "import" and args.format == "hf-llava-parts":
        from tessera.ckpt_convert.importers.llava_parts import import_llava_parts

        if args.vision is None or args.language is None or args.input is not None:
            raise UserError("--format hf-llava-parts reads --vision DIR and --language DIR (not --input)")
        out = import_llava_parts(args.vision, args.language, args.output, args.image_token, args.vision_feature_layer,
                                 args.seed, dtype=parse_dtype(args.dtype), overwrite=args.overwrite, quiet=args.quiet,
                                 sync=args.sync)
        print(out)
    elif args.verb == "import" and args.input is None:
        raise UserError(f"--format {args.format} reads --input DIR")
    elif args.verb == "import" and args.format == "megatron":
        from tessera.ckpt_convert.importers.megatron import import_megatron

        if args.model_config is None:
            raise UserError("--format megatron needs --model-config FILE (the model the checkpoint holds)")
        out = import_megatron(args.input, args.output, args.model_config, args.tokenizer, dtype=parse_dtype(args.dtype),
                              overwrite=args.overwrite, quiet=args.quiet, sync=args.sync)
        print(out)
    elif args.verb == "import":
        from tessera.ckpt_convert.importers.hf import import_hf
        from tessera.common.models.causal_lm.config import MAX_VOCAB_MULTIPLE

        if args.model_config is not None or args.tokenizer is not None:
            raise UserError("--model-config/--tokenizer apply to --format megatron; an HF directory has both")

        multiple = args.vocab_size_divisible_by
        if multiple is not None:
            multiple = _positive("--vocab-size-divisible-by", multiple, MAX_VOCAB_MULTIPLE)
        out = import_hf(args.input, args.output, dtype=parse_dtype(args.dtype), vocab_size_divisible_by=multiple,
                        overwrite=args.overwrite, quiet=args.quiet, sync=args.sync)
        print(out)
    elif args.verb == "verify":
        from tessera.ckpt_convert.inspect import verify

        report = verify(args.checkpoint, read_tensors=not args.no_read, quiet=args.quiet)
        print(report)
    elif args.verb == "info":
        from tessera.ckpt_convert.inspect import info, info_text

        summary = info(args.checkpoint)
        if args.json:
            import json

            print(json.dumps(summary, indent=2))
        else:
            print(info_text(summary))
    return 0


def main(argv: list[str] | None = None) -> None:
    """Console entry point: user errors become one stderr line and exit 2."""
    run_cli(run, argv)


if __name__ == "__main__":
    main(sys.argv[1:])
