"""`tessera-ckpt import --format hf`: a transformers directory (any family of a kind the converter
handles: causal LMs, hybrid Nemotron-H and Mamba2) -> a Tessera checkpoint.

Reads config.json (-> ModelConfig, unsupported architectures refused) and the safetensors
weights (one file, or shards listed in model.safetensors.index.json; pickled `.bin` weights are
refused, never unpickled), maps names and layouts back (the one HF adapter, tessera.common.hf,
which the server uses too), and writes a single-rank DCP payload tensor by tensor, the sidecar,
and the tokenizer when the directory has one (chat_template.jinja included); generation_config.json's
end ids and sampling defaults go into the sidecar (`generation`). The output is a
checkpoints directory (iter_0000000/ + pointer): the trainer resumes from its weights, the server
loads it.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import torch

from tessera.ckpt_convert.dcp_writer import write_imported_checkpoint
from tessera.ckpt_convert.kinds import check_convertible
from tessera.ckpt_convert.progress import Progress
from tessera.common.checkpoint import CHECKPOINT_KIND, is_checkpoint_output
from tessera.common.errors import UserError
from tessera.common.fileio import artifact_path, atomic_directory, check_output_directory
from tessera.common.hf.directory import CONFIG, SafetensorsWeights, read_hf_config
from tessera.common.hf.generation import GENERATION_CONFIG, read_generation_config
from tessera.common.hf.rules import check_import
from tessera.common.models.causal_lm.config import ModelConfig
from tessera.common.models.registry import hf_adapter
from tessera.common.tokenizer import check_tokenizer_fits, load_tokenizer


def imported_generation(input_dir: Path):
    """generation_config.json's end ids and sampling defaults, for the sidecar (None without the file).
    Real repositories ship odd values (top_p 0, a string): the model imports, such a value does not."""
    generation = read_generation_config(input_dir, lambda message: print(f"warning: {message}", file=sys.stderr))
    for name, value in (generation.ignored or {}).items() if generation is not None else ():
        print(f"warning: {input_dir / GENERATION_CONFIG}: field {name} is {value!r}, which the sampler cannot "
              "take; left out of the checkpoint's generation settings (tessera-ckpt info lists it)", file=sys.stderr)
    return generation


def import_hf(input_dir: str | Path, output: str | Path, dtype: torch.dtype | None = None,
              vocab_size_divisible_by: int | None = None, overwrite: bool = False, quiet: bool = False, sync: bool = True) -> Path:
    """`vocab_size_divisible_by`: the causal LM's vocabulary padding (None: 128); hybrid models are
    not padded. `sync=False`: no fsync of the output (see options.NO_SYNC_HELP); still renamed when whole."""
    input_dir, output = Path(input_dir), Path(output)
    if not input_dir.is_dir():
        raise UserError(f"{input_dir}: input directory not found")
    check_output_directory(output, overwrite, [input_dir], CHECKPOINT_KIND, is_checkpoint_output)
    config_path = artifact_path(input_dir, CONFIG)
    cfg, _ = read_hf_config(input_dir)  # the one HF adapter, shared with tessera-serve
    check_convertible(cfg, "import --format hf")
    generation = imported_generation(input_dir)
    if isinstance(cfg, ModelConfig):
        # Megatron's vocabulary padding at tensor parallel 1 (zero rows; reshard re-pads for larger sizes).
        multiple = 128 if vocab_size_divisible_by is None else vocab_size_divisible_by
        cfg = cfg.model_copy(update={"vocab_size_divisible_by": multiple}).padded_for(1)
    elif vocab_size_divisible_by not in (None, 1):
        raise UserError(f"--vocab-size-divisible-by {vocab_size_divisible_by}: {config_path} is a {cfg.kind} model, "
                        "whose embedding and head keep exactly vocab_size rows; drop the flag")
    weights = SafetensorsWeights(input_dir)  # zero-copy: each tensor a map of its file bytes
    rules, optional = hf_adapter(cfg).import_rules(cfg, weights.names())
    check_import(rules, weights, str(input_dir), optional)  # every input tensor, before writing anything
    tok = load_tokenizer(input_dir) if (input_dir / "tokenizer.json").is_file() else None
    if tok is not None:
        check_tokenizer_fits(tok, cfg.vocab_size, str(config_path))  # the check serving makes, before writing
    else:
        print(f"warning: {input_dir} has no tokenizer.json; the checkpoint will have no tokenizer/ "
              "(needed to serve it: add one from the original model)", file=sys.stderr)
    # The stored dtype; where tensors differ (rare), float32 holds every one of them exactly.
    stored = {weights.dtype(s) for r in rules for s in r.sources}
    out_dtype = dtype or (stored.pop() if len(stored) == 1 else torch.float32)
    itemsize = out_dtype.itemsize
    total = sum(itemsize * _numel(r.shape) for r in rules)

    with atomic_directory(output, overwrite=overwrite, sync=sync) as tmp, \
            Progress(total, len(rules), f"import hf -> {output.name}", quiet) as bar:
        tensors = ((rule.target, rule.apply([weights.get(s) for s in rule.sources])) for rule in rules)
        write_imported_checkpoint(tmp, tensors, cfg, tok, out_dtype, {
            "path": str(input_dir.resolve()), "format": "hf",
            "config_sha256": hashlib.sha256(config_path.read_bytes()).hexdigest()}, bar, sync, generation)
    return output


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
