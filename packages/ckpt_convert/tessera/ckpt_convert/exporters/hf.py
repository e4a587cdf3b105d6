"""`tessera-ckpt export --format hf`: a checkpoint -> a Hugging Face transformers model directory.

Output (see docs/formats/exports.md): config.json, generation_config.json, model.safetensors (or
model-0000i-of-0000n.safetensors + model.safetensors.index.json when larger than the shard
limit), tokenizer.json, tokenizer_config.json (+ chat_template.jinja when the checkpoint has
one). Names, layouts and config.json come from the one HF adapter (tessera.common.hf). Written
into a temporary directory that is renamed to the output only when complete. Memory: one output tensor (plus its inputs) at a time; a tensor
that needs no change is written straight from the checkpoint's memory-mapped file.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tessera.ckpt_convert.kinds import check_convertible
from tessera.ckpt_convert.mapped import Staging
from tessera.ckpt_convert.progress import Progress
from tessera.ckpt_convert.safetensors_stream import PlannedTensor, SafetensorsStreamWriter
from tessera.ckpt_convert.source import CheckpointSource
from tessera.ckpt_convert.tokenizer_files import write_hf_tokenizer
from tessera.common.fileio import (
    BackgroundFsync,
    atomic_directory,
    atomic_write_json,
    check_output_directory,
    holds_only,
)
from tessera.common.hf.directory import is_hf_directory
from tessera.common.hf.generation import GenerationSettings
from tessera.common.models.causal_lm.config import ModelConfig
from tessera.common.models.causal_lm.model import model_tensor_shapes
from tessera.common.models.registry import hf_adapter, kind_of
from tessera.common.tokenizer import TOKENIZER_FILES, Tokenizer

ST_METADATA = {"format": "pt"}
INDEX_FILE = "model.safetensors.index.json"
_EXPORT_FILE_RE = re.compile(r"^(config\.json|generation_config\.json|model(-\d+-of-\d+)?\.safetensors|"
                             + re.escape(INDEX_FILE) + ")$")


@dataclass(frozen=True)
class ExportOptions:
    dtype: torch.dtype | None = None  # None: the stored dtype
    max_shard_size: int = 5 * 10**9
    overwrite: bool = False
    quiet: bool = False
    sync: bool = True  # False: no fsync of the output (options.NO_SYNC_HELP); still renamed when whole


def expected_model_shapes(cfg: Any) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of the Tessera model for `cfg` (the model's own, on the meta device):
    a causal LM's parameters, another kind's stored tensors (its registry entry's tensor_shapes)."""
    if isinstance(cfg, ModelConfig):
        return model_tensor_shapes(cfg, buffers=False)
    shapes = kind_of(cfg).tensor_shapes
    assert shapes is not None, "check_convertible admits only kinds with tensor_shapes"
    return shapes(cfg)


def plan_shards(tensors: list[PlannedTensor], max_shard_size: int) -> list[list[PlannedTensor]]:
    """Greedy split in order; a tensor larger than the limit gets a shard of its own (as transformers does)."""
    shards: list[list[PlannedTensor]] = [[]]
    size = 0
    for t in tensors:
        if shards[-1] and size + t.nbytes > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return shards


def shard_names(n: int) -> list[str]:
    if n == 1:
        return ["model.safetensors"]
    return [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def is_hf_export(path: Path) -> bool:
    """An HF model directory holding nothing but what export_hf writes (config files, safetensors
    shards and index, tokenizer files): what its --overwrite may replace."""
    return is_hf_directory(path) and holds_only(path, lambda name: bool(_EXPORT_FILE_RE.match(name))
                                                or name in TOKENIZER_FILES)


def export_hf(checkpoint: str | Path, output: str | Path, opts: ExportOptions) -> Path:
    src = CheckpointSource(checkpoint)
    output = Path(output)
    check_output_directory(output, opts.overwrite, [src.directory],
                           "Hugging Face model directory (config.json + safetensors)", is_hf_export)
    cfg = src.sidecar.model
    check_convertible(cfg, "export --format hf")
    rules = hf_adapter(cfg).export_rules(cfg)  # their sources are the stored tensors: CheckpointSource checked them
    tok = src.tokenizer()
    if tok is None:
        print(f"warning: {src.directory} has no tokenizer/; exporting the model without tokenizer files",
              file=sys.stderr)

    first_source = next(r.sources[0] for r in rules if r.sources)
    dtype = opts.dtype or src.model_specs[first_source].dtype
    planned = [PlannedTensor(r.target, r.shape, dtype) for r in rules]
    # Shards split in the model's order, as transformers splits them; within a file, tensors in
    # safetensors' own order (by dtype, then name: one dtype here), so the bytes are transformers'.
    shards = [sorted(shard, key=lambda t: t.name) for shard in plan_shards(planned, opts.max_shard_size)]
    names = shard_names(len(shards))
    by_name = {r.target: r for r in rules}
    total = sum(t.nbytes for t in planned)

    with src.checksum_check() as checksums, atomic_directory(output, overwrite=opts.overwrite, sync=opts.sync) as tmp, \
            BackgroundFsync(sync=opts.sync) as syncer, \
            Progress(total, len(rules), f"export hf -> {output.name}", opts.quiet) as bar:
        staging = Staging()
        for shard, fname in zip(shards, names):
            f = open(tmp / fname, "wb")
            try:
                writer = SafetensorsStreamWriter(f, shard, ST_METADATA, staging=staging, sync=opts.sync)
                for t in shard:
                    rule = by_name[t.name]
                    # A rule that only renames passes its input straight to the writer: raw (mapped) is fine.
                    inputs = src.load_model(list(rule.sources), raw=rule.combine is None) if rule.sources else {}
                    out = rule.apply([inputs[s] for s in rule.sources])
                    writer.write(t.name, out)  # converts to `dtype` on the way when needed
                    del inputs, out
                    bar.update(t.nbytes)
                writer.close()
            except BaseException:
                f.close()
                raise
            syncer.submit(f)  # fsynced and closed in the background while the next shard is written
        syncer.wait()  # every shard durable before the directory is published
        if len(shards) > 1:
            atomic_write_json(tmp / INDEX_FILE, {
                "metadata": {"total_size": sum(t.nbytes for t in planned)},
                "weight_map": {t.name: fname for shard, fname in zip(shards, names) for t in shard},
            }, sync=opts.sync)
        write_config_files(tmp, cfg, dtype, tok, sync=opts.sync, generation=src.sidecar.generation)
        checksums.wait()  # the input's checksums must match before the output is committed
    return output


def write_config_files(out: Path, cfg: Any, dtype: torch.dtype, tok: Tokenizer | None,
                       sync: bool = True, generation: GenerationSettings | None = None) -> None:
    """config.json, generation_config.json and the tokenizer files. generation_config.json: the ids
    of the tokenizer (or the kind's own fields), then the checkpoint's generation settings over them
    (its end ids, do_sample and sampling defaults, as the imported model's file had them)."""
    bos = tok.bos_id if tok else None
    eos = tok.eos_id if tok else None
    pad = tok.pad_id if tok else None
    adapter = hf_adapter(cfg)
    atomic_write_json(out / "config.json", adapter.hf_config(cfg, dtype, bos, eos, pad), sync=sync)
    extra = generation.to_hf() if generation is not None else {}
    gen = None
    if hasattr(adapter, "generation_config"):  # a kind whose transformers class writes its own (T5)
        gen = adapter.generation_config(cfg)
    elif getattr(adapter, "GENERATES", True):  # an encoder's classes have no generation config
        gen = {"_from_model_config": True, "bos_token_id": bos, "eos_token_id": eos}
        if pad is not None:
            gen["pad_token_id"] = pad
    if gen is not None:
        # transformers' flag: true only while the file holds nothing beyond what the model config gives.
        if any(gen.get(k) != v for k, v in extra.items()):
            gen = {**gen, "_from_model_config": False, **extra}
        atomic_write_json(out / "generation_config.json", gen, sync=sync)
    if tok is not None:
        write_hf_tokenizer(tok, out, sync=sync)
