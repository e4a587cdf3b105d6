"""Reading a Hugging Face model directory: config.json, where each tensor lives, the weights
themselves (safetensors only), and the end-of-sequence ids.

What transformers' `save_pretrained` writes (any version) and what `tessera-ckpt export` writes:
config.json, model.safetensors or shards listed in model.safetensors.index.json,
generation_config.json, and tokenizer files (read by `tessera.common.tokenizer`). Pickled
`pytorch_model*.bin` weights are refused, never unpickled.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from tessera.common.errors import ArtifactError
from tessera.common.fileio import read_json
from tessera.common.hf.registry import import_rules, model_config_from_hf
from tessera.common.hf.rules import check_import
from tessera.common.model_config import ModelConfig

CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
# safetensors dtype names -> torch (those torch has); anything else is refused by name.
_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


def is_hf_directory(path: str | os.PathLike) -> bool:
    """A config.json beside weights (safetensors, or pickled .bin files, which are then refused)."""
    path = Path(path)
    return (path / CONFIG).is_file() and ((path / SAFETENSORS).is_file() or (path / SAFETENSORS_INDEX).is_file()
                                          or any(path.glob("pytorch_model*.bin")))


def read_hf_config(directory: str | os.PathLike) -> tuple[ModelConfig, dict[str, Any]]:
    """(the ModelConfig, the raw config.json) of an HF directory; refusals name config.json."""
    path = Path(directory) / CONFIG
    data = read_json(path, "Hugging Face config.json")
    return model_config_from_hf(data, str(path)), data


def weight_files(directory: str | os.PathLike) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (from the index, else the single file)."""
    directory = Path(directory)
    index = directory / SAFETENSORS_INDEX
    if index.is_file():
        weight_map = read_json(index, "safetensors index").get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map or not all(isinstance(v, str) for v in weight_map.values()):
            raise ArtifactError(f"{index}: no valid weight_map; the index is corrupt")
        where = {k: directory / v for k, v in weight_map.items()}
        for path in sorted(set(where.values())):
            if not path.is_file():
                raise ArtifactError(f"{path}: listed in {SAFETENSORS_INDEX} but missing")
        return where
    single = directory / SAFETENSORS
    if single.is_file():
        return {name: single for name in _open(single).keys()}
    if any(directory.glob("pytorch_model*.bin")):
        raise ArtifactError(f"{directory}: only pickled pytorch_model*.bin weights found; Tessera reads safetensors "
                            "only (it never unpickles): convert them with transformers' "
                            "save_pretrained(dir, safe_serialization=True)")
    raise ArtifactError(f"{directory}: no {SAFETENSORS} or {SAFETENSORS_INDEX}; not a Hugging Face model directory")


def _open(path: Path) -> Any:
    from safetensors import safe_open

    try:
        return safe_open(str(path), framework="pt")
    except Exception as exc:  # the Rust library raises its own error types
        raise ArtifactError(f"{path}: not a readable safetensors file ({str(exc).splitlines()[0][:200]})") from None


class SafetensorsWeights:
    """A `WeightSource` over an HF directory's safetensors files (headers read up front, each
    tensor loaded when asked for)."""

    def __init__(self, directory: str | os.PathLike):
        self.where = weight_files(directory)
        self._handles: dict[Path, Any] = {}
        for name, path in self.where.items():
            if name not in self._handle(path).keys():
                raise ArtifactError(f"{path}: has no tensor {name!r}, which {SAFETENSORS_INDEX} places there")

    def _handle(self, path: Path) -> Any:
        if path not in self._handles:
            self._handles[path] = _open(path)
        return self._handles[path]

    def names(self) -> set[str]:
        return set(self.where)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(self.where[name]).get_slice(name).get_shape())

    def dtype(self, name: str) -> torch.dtype:
        stored = self._handle(self.where[name]).get_slice(name).get_dtype()
        if stored not in _ST_DTYPES:
            raise ArtifactError(f"{self.where[name]}: tensor {name!r} has dtype {stored}, which Tessera does not read")
        return _ST_DTYPES[stored]

    def get(self, name: str) -> torch.Tensor:
        path = self.where[name]
        try:
            return self._handle(path).get_tensor(name)
        except Exception as exc:
            raise ArtifactError(f"{path}: tensor {name!r} unreadable ({str(exc).splitlines()[0][:200]}); "
                                "the file is corrupt or truncated") from None


def load_hf_weights(directory: str | os.PathLike, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Every parameter of `Transformer(cfg)`, in Tessera names, from an HF directory (validated
    first: names, shapes, float dtypes, no tensor left unused)."""
    weights = SafetensorsWeights(directory)
    rules, optional = import_rules(cfg, weights.names())
    check_import(rules, weights, str(directory), optional)
    return {r.target: r.apply([weights.get(s) for s in r.sources]).contiguous() for r in rules}


def eos_token_ids(directory: str | os.PathLike, config: dict[str, Any]) -> list[int]:
    """Every id that ends generation per config.json and generation_config.json (an int or a list)."""
    eos: set[int] = set()
    gen_path = Path(directory) / GENERATION_CONFIG
    gen = read_json(gen_path, "generation config") if gen_path.is_file() else {}
    for source in (config, gen if isinstance(gen, dict) else {}):
        value = source.get("eos_token_id")
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, int) and not isinstance(v, bool):
                eos.add(v)
    return sorted(eos)
