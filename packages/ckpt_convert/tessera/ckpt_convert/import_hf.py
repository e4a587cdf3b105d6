"""`tessera-ckpt import --format hf`: a transformers Llama / GPT-2 directory -> a Tessera checkpoint.

Reads config.json (-> ModelConfig, unsupported architectures refused) and the safetensors
weights (one file, or shards listed in model.safetensors.index.json; pickled `.bin` weights are
refused, never unpickled), maps names and layouts back (hf_mapping.import_rules), and writes a
single-rank DCP payload tensor by tensor, the sidecar, and the tokenizer when the directory has
one. The output is a checkpoints directory (iter_0000000/ + pointer): the trainer resumes from its
weights, the server loads it.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import torch

from tessera.ckpt_convert.dcp_writer import ShardedDcpWriter, whole
from tessera.ckpt_convert.hf_mapping import import_rules, model_config_from_hf
from tessera.ckpt_convert.progress import Progress
from tessera.ckpt_convert.safetensors_stream import SafetensorsFile
from tessera.common.checkpoint import CheckpointSidecar, finalize_checkpoint, iter_dir_name, write_pointer
from tessera.common.errors import ArtifactError, UserError
from tessera.common.fileio import atomic_directory, fsync_tree, read_json
from tessera.common.tokenizer import load_tokenizer

INDEX_FILE = "model.safetensors.index.json"
_IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq")  # buffers, not weights


class SafetensorsDir:
    """Per-tensor access to an HF directory's safetensors weights, each tensor memory-mapped
    (mapped only while it is in use, so resident memory follows the tensors in use)."""

    def __init__(self, directory: Path):
        self.directory = directory
        self._files: dict[Path, SafetensorsFile] = {}  # parsed headers, one per file
        index = directory / INDEX_FILE
        if index.is_file():
            weight_map = read_json(index, "safetensors index").get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise ArtifactError(f"{index}: no weight_map; the index is corrupt")
            self.where = {k: directory / v for k, v in weight_map.items()}
        elif (directory / "model.safetensors").is_file():
            single = directory / "model.safetensors"
            self.where = {k: single for k in self._file(single).tensors}
        elif any(directory.glob("pytorch_model*.bin")):
            raise UserError(f"{directory}: only pickled pytorch_model*.bin weights found; tessera-ckpt reads "
                            "safetensors only (never unpickles); re-save with save_pretrained(safe_serialization=True)")
        else:
            raise ArtifactError(f"{directory}: no model.safetensors or {INDEX_FILE}; not a Hugging Face model directory")
        for path in set(self.where.values()):
            if not path.is_file():
                raise ArtifactError(f"{path}: listed in {INDEX_FILE} but missing")
        for name, path in self.where.items():
            if name not in self._file(path).tensors:
                raise ArtifactError(f"{path}: has no tensor {name!r}, which {INDEX_FILE} places there")

    def _file(self, path: Path) -> SafetensorsFile:
        if path not in self._files:
            self._files[path] = SafetensorsFile(path)
        return self._files[path]

    def names(self) -> set[str]:
        return {k for k in self.where if not k.endswith(_IGNORED_SUFFIXES)}

    def get(self, name: str) -> torch.Tensor:
        return self._file(self.where[name]).get(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._file(self.where[name]).tensors[name].shape

    def dtype(self, name: str) -> torch.dtype:
        return self._file(self.where[name]).tensors[name].dtype


def import_hf(input_dir: str | Path, output: str | Path, dtype: torch.dtype | None = None,
              overwrite: bool = False, quiet: bool = False, sync: bool = True) -> Path:
    """`sync=False`: no fsync of the output (see options.NO_SYNC_HELP); still renamed when whole."""
    input_dir, output = Path(input_dir), Path(output)
    if not input_dir.is_dir():
        raise UserError(f"{input_dir}: input directory not found")
    if output.exists() and not overwrite:
        raise UserError(f"{output}: output already exists; choose another path or pass --overwrite")
    config_path = input_dir / "config.json"
    hf_cfg = read_json(config_path, "Hugging Face config.json")
    if not isinstance(hf_cfg, dict):
        raise ArtifactError(f"{config_path}: expected a JSON object")
    cfg = model_config_from_hf(hf_cfg, str(config_path))
    weights = SafetensorsDir(input_dir)
    tok = load_tokenizer(input_dir) if (input_dir / "tokenizer.json").is_file() else None
    if tok is None:
        print(f"warning: {input_dir} has no tokenizer.json; the checkpoint will have no tokenizer/ "
              "(needed to serve it: add one from the original model)", file=sys.stderr)
    names = weights.names()
    rules = import_rules(cfg, names)
    # Validate every input tensor before writing anything.
    for rule in rules:
        for s in rule.sources:
            if s not in names:
                raise ArtifactError(f"{input_dir}: tensor {s!r} missing from the safetensors weights")
        if rule.combine is None and weights.shape(rule.sources[0]) != rule.shape:
            raise ArtifactError(f"{input_dir}: tensor {rule.sources[0]!r} has shape "
                                f"{list(weights.shape(rule.sources[0]))}, config.json implies {list(rule.shape)}")
    out_dtype = dtype or weights.dtype(rules[0].sources[0])
    itemsize = out_dtype.itemsize
    total = sum(itemsize * _numel(r.shape) for r in rules)

    with atomic_directory(output, overwrite=overwrite, sync=sync) as tmp, \
            Progress(total, len(rules), f"import hf -> {output.name}", quiet) as bar:
        target = tmp / iter_dir_name(0)
        writer = ShardedDcpWriter(target, 1, sync=sync)
        try:
            for rule in rules:
                # A view or another dtype is materialised by the writer in its reused staging buffer.
                tensor = rule.apply([weights.get(s) for s in rule.sources])
                writer.write_tensor("model." + rule.target, tensor, whole(rule.shape), dtype=out_dtype)
                bar.update(tensor.numel() * itemsize)
                del tensor
        except BaseException:
            writer.abort()
            raise
        checksums = writer.close()
        if tok is not None:
            tok.save(target / "tokenizer")
            if sync:
                fsync_tree(target / "tokenizer")
        sidecar = CheckpointSidecar(model=cfg, tokenizer_fingerprint=tok.fingerprint if tok else None,
                                    params_dtype=str(out_dtype).removeprefix("torch."))
        sidecar.imported_from = {  # type: ignore[attr-defined]  # extra field, kept by the sidecar model
            "path": str(input_dir.resolve()), "format": "hf",
            "config_sha256": hashlib.sha256(config_path.read_bytes()).hexdigest()}
        finalize_checkpoint(target, sidecar, checksums, sync=sync)  # rank files hashed as written; .metadata here
        write_pointer(tmp, 0, sync=sync)
    return output


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
