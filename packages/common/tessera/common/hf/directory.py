"""Reading a Hugging Face model directory: config.json, where each tensor lives, the weights
themselves (safetensors only), and the end-of-sequence ids. The one reader, for `tessera-ckpt
import` and for the server loading an HF directory.

What transformers' `save_pretrained` writes (any version) and what `tessera-ckpt export` writes:
config.json, model.safetensors or shards listed in model.safetensors.index.json,
generation_config.json, and tokenizer files (read by `tessera.common.tokenizer`). Pickled
`pytorch_model*.bin` weights are refused, never unpickled.

Weights are read zero-copy: each safetensors header is parsed and checked once (dtypes, shapes,
offsets inside the file, so a truncated file is refused before anything is written), and each
tensor is a private memory map of its bytes (tessera.common.file_map), mapped only while it is in
use, so resident memory follows the tensors in use and an importer can copy them file to file.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tessera.common.errors import ArtifactError
from tessera.common.file_map import map_tensor
from tessera.common.fileio import artifact_path, read_json
from tessera.common.hf.generation import GenerationSettings, read_generation_config
from tessera.common.hf.rules import check_import
from tessera.common.models.registry import hf_adapter, model_config_from_hf

CONFIG = "config.json"
SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
# safetensors dtype names -> torch (those torch has); anything else is refused by name.
SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
_MAX_HEADER = 100 << 20  # safetensors' own limit on the JSON header


def is_hf_directory(path: str | os.PathLike) -> bool:
    """A config.json beside weights (safetensors, or pickled .bin files, which are then refused)."""
    path = Path(path)
    return (path / CONFIG).is_file() and ((path / SAFETENSORS).is_file() or (path / SAFETENSORS_INDEX).is_file()
                                          or any(path.glob("pytorch_model*.bin")))


def read_hf_config(directory: str | os.PathLike) -> tuple[Any, dict[str, Any]]:
    """(the model config, of the kind config.json describes, and the raw config.json) of an HF
    directory; refusals name config.json."""
    path = artifact_path(directory, CONFIG)
    data = read_json(path, "Hugging Face config.json")
    cfg = model_config_from_hf(data, str(path))
    mtp = getattr(cfg, "mtp", None)
    if mtp is not None:
        # transformers writes num_nextn_predict_layers=1 but never saves the layers: keep the
        # depths whose tensors (layer num_hidden_layers + k, as DeepSeek stores them) are here.
        layers = {n.removeprefix("model.").split(".")[1] for n in weight_files(directory)
                  if n.removeprefix("model.").startswith("layers.")}
        depth = next((k for k in range(mtp.depth) if str(cfg.num_layers + k) not in layers), mtp.depth)
        if depth != mtp.depth:
            cfg = cfg.model_copy(update={"mtp": mtp.model_copy(update={"depth": depth}) if depth else None})
    return cfg, data


def weight_files(directory: str | os.PathLike, open_file: Callable[[Path], SafetensorsFile] | None = None
                 ) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (from the index, else the single file, whose
    header `open_file` parses: SafetensorsWeights passes its cache, so the header is parsed once)."""
    directory = Path(directory)
    index = artifact_path(directory, SAFETENSORS_INDEX)
    if index.is_file():
        weight_map = read_json(index, "safetensors index").get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map or not all(isinstance(v, str) for v in weight_map.values()):
            raise ArtifactError(f"{index}: no valid weight_map; the index is corrupt")
        files = {v: artifact_path(directory, v) for v in set(weight_map.values())}
        where = {k: files[v] for k, v in weight_map.items()}
        for path in sorted(set(where.values())):
            if not path.is_file():
                raise ArtifactError(f"{path}: listed in {SAFETENSORS_INDEX} but missing")
        return where
    single = artifact_path(directory, SAFETENSORS)
    if single.is_file():
        return {name: single for name in (open_file or SafetensorsFile)(single).tensors}
    if any(directory.glob("pytorch_model*.bin")):
        raise ArtifactError(f"{directory}: only pickled pytorch_model*.bin weights found; Tessera reads safetensors "
                            "only (it never unpickles): convert them with transformers' "
                            "save_pretrained(dir, safe_serialization=True)")
    raise ArtifactError(f"{directory}: no {SAFETENSORS} or {SAFETENSORS_INDEX}; not a Hugging Face model directory")


@dataclass(frozen=True)
class StoredTensor:
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    nbytes: int


class SafetensorsFile:
    """The index of one safetensors file (parsed and checked once), and its tensors, mapped."""

    def __init__(self, path: Path):
        self.path = path
        try:
            size = path.stat().st_size
            with open(path, "rb") as f:
                head = f.read(8)
                n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
                if not 0 < n <= min(_MAX_HEADER, size - 8):
                    raise ValueError("header length out of range")
                header = json.loads(f.read(n))
            base = 8 + n
            self.tensors: dict[str, StoredTensor] = {}
            for name, entry in header.items():
                if name == "__metadata__":
                    continue
                dtype = SAFETENSORS_DTYPES.get(entry["dtype"])
                if dtype is None:
                    raise ValueError(f"tensor {name!r} has dtype {entry['dtype']}, which Tessera does not read")
                shape = tuple(int(d) for d in entry["shape"])
                start, end = (int(x) for x in entry["data_offsets"])
                if end - start != math.prod(shape) * dtype.itemsize or start < 0:
                    raise ValueError(f"tensor {name!r}: data_offsets {start}..{end} do not fit its shape and dtype")
                if base + end > size:
                    raise ValueError(f"tensor {name!r} ends at byte {base + end}, past the end of the file "
                                     f"({size} bytes): truncated")
                self.tensors[name] = StoredTensor(dtype, shape, base + start, end - start)
            # Two tensors sharing bytes (the safetensors library refuses such a header) would load
            # one tensor's values under another's name, e.g. q_proj read as o_proj, and pass every check.
            spans = sorted((t.offset, t.offset + t.nbytes, n) for n, t in self.tensors.items() if t.nbytes)
            for (_, end_a, a), (start_b, _, b) in zip(spans, spans[1:]):
                if start_b < end_a:
                    raise ValueError(f"tensors {a!r} and {b!r} overlap in the file (data_offsets)")
        except (OSError, ValueError, KeyError, TypeError, AttributeError, struct.error) as exc:
            raise ArtifactError(f"{path}: not a readable safetensors file ({str(exc).splitlines()[0][:200]}); "
                                "it is corrupt or truncated") from None

    def get(self, name: str) -> torch.Tensor:
        t = self.tensors[name]
        try:
            return map_tensor(self.path, t.offset, t.dtype, t.shape)
        except (OSError, ValueError) as exc:  # e.g. the file shrank since its header was read
            raise ArtifactError(f"{self.path}: tensor {name!r} unreadable ({str(exc).splitlines()[0][:200]}); "
                                "the file is corrupt or truncated") from None


class SafetensorsWeights:
    """A `WeightSource` (tessera.common.hf.rules) over an HF directory's safetensors weights, each
    tensor memory-mapped when asked for (headers parsed and checked up front)."""

    def __init__(self, directory: str | os.PathLike):
        self._files: dict[Path, SafetensorsFile] = {}  # parsed headers, one per file
        self.where = weight_files(directory, self._file)  # refuses pickled .bin weights
        for name, path in self.where.items():
            if name not in self._file(path).tensors:
                raise ArtifactError(f"{path}: has no tensor {name!r}, which {SAFETENSORS_INDEX} places there")

    def _file(self, path: Path) -> SafetensorsFile:
        if path not in self._files:
            self._files[path] = SafetensorsFile(path)
        return self._files[path]

    def names(self) -> set[str]:
        return set(self.where)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._file(self.where[name]).tensors[name].shape

    def dtype(self, name: str) -> torch.dtype:
        return self._file(self.where[name]).tensors[name].dtype

    def get(self, name: str) -> torch.Tensor:
        return self._file(self.where[name]).get(name)


def checked_hf_weights(directory: str | os.PathLike, cfg: Any) -> tuple[SafetensorsWeights, list]:
    """The directory's weights and the rules that import them, validated from the headers alone
    (names, shapes, float dtypes, no tensor left unused); no tensor data is read."""
    weights = SafetensorsWeights(directory)
    rules, optional = hf_adapter(cfg).import_rules(cfg, weights.names())
    check_import(rules, weights, str(directory), optional)
    return weights, rules


def imported_tensors(weights: SafetensorsWeights, rules: list) -> dict[str, torch.Tensor]:
    """Every parameter, in Tessera names, from what `checked_hf_weights` returned (not checked again)."""
    return {r.target: r.apply([weights.get(s) for s in r.sources]).contiguous() for r in rules}


def load_hf_weights(directory: str | os.PathLike, cfg: Any) -> dict[str, torch.Tensor]:
    """Every parameter of `cfg`'s model, in Tessera names, from an HF directory (validated
    first: names, shapes, float dtypes, no tensor left unused)."""
    return imported_tensors(*checked_hf_weights(directory, cfg))


def eos_token_ids(directory: str | os.PathLike, config: dict[str, Any],
                  generation: GenerationSettings | None = None) -> list[int]:
    """Every id that ends generation per config.json (an int or a list) and the generation
    settings (`generation`: generation_config.json's, read here when not given)."""
    eos: set[int] = set()
    value = config.get("eos_token_id")
    for v in value if isinstance(value, list) else [value]:
        if isinstance(v, int) and not isinstance(v, bool):
            eos.add(v)
    if generation is None:
        generation = read_generation_config(directory)
    return sorted(eos | set(generation.eos_token_ids if generation is not None else ()))
