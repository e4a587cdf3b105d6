"""The pooling a model directory declares, read from its sentence-transformers files.

sentence-transformers saves a model as modules run in order (`modules.json`): the Transformer
(the model in the directory itself), then `Pooling` (`1_Pooling/config.json`: which positions make
the sentence vector), optionally `Normalize` (unit length). `sentence_bert_config.json` holds the
Transformer module's `max_seq_length` (longer inputs are cut there; the server refuses them unless
the request asks to truncate) and `do_lower_case`. Matryoshka models (vLLM's convention:
`is_matryoshka` or `matryoshka_dimensions` in config.json) may be asked for shorter vectors.

Only what the engine reproduces exactly is accepted: one of CLS, mean or last-token pooling over
every token (prompt included), then at most Normalize. Any other module (Dense, LayerNorm, ...) or
pooling mode is refused in one line naming the file, never served as something else. Every file is
opened through `artifact_path`, so a link cannot lead the server out of the directory.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any

from tessera.common.errors import ArtifactError
from tessera.common.fileio import artifact_path, read_json

MODULES = "modules.json"
SBERT_CONFIG = "sentence_bert_config.json"
MODES = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean", "pooling_mode_lasttoken": "last"}
UNSUPPORTED_MODES = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")
_TRANSFORMER, _POOLING, _NORMALIZE = "Transformer", "Pooling", "Normalize"


@dataclass(frozen=True)
class PoolingSpec:
    mode: str  # cls | mean | last
    normalize: bool  # unit L2 length after pooling (a Normalize module)
    dim: int  # the pooled vector's length (the hidden size)
    max_seq_length: int | None = None  # sentence_bert_config.json; None: the model's own limit
    do_lower_case: bool = False  # text is lower-cased before tokenizing (sentence_bert_config.json)
    matryoshka: tuple[int, ...] | bool = False  # dimensions a request may ask for (True: any up to dim)
    # The longest input the server takes (set by the engine): max_seq_length, the engine's
    # max_model_len and its step budget (an input is computed in one step), whichever is least.
    max_input_tokens: int = 0

    def to_wire(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> PoolingSpec:
        m = data["matryoshka"]
        return cls(**{**data, "matryoshka": tuple(m) if isinstance(m, list) else bool(m)})


def _module_type(entry: Any, where: str) -> tuple[str, str]:
    if not isinstance(entry, dict) or not isinstance(entry.get("type"), str) or not isinstance(entry.get("path", ""), str):
        raise ArtifactError(f"{where}: each module must be an object with a string `type` and `path`")
    return entry["type"].rsplit(".", 1)[-1], entry.get("path", "")


def read_pooling_spec(directory: str | os.PathLike, hidden_size: int, hf_config: dict[str, Any]) -> PoolingSpec | None:
    """The directory's declared pooling, or None when it has no modules.json (a generative model)."""
    modules_path = artifact_path(directory, MODULES)
    if not modules_path.exists():
        return None
    modules = read_json(modules_path, "sentence-transformers modules.json")
    if not isinstance(modules, list) or not modules:
        raise ArtifactError(f"{modules_path}: expected a non-empty list of modules")
    types = [_module_type(m, str(modules_path)) for m in modules]
    names = [t for t, _ in types]
    if names[:2] != [_TRANSFORMER, _POOLING] or names[2:] not in ([], [_NORMALIZE]):
        raise ArtifactError(f"{modules_path}: modules {', '.join(names)}: this server runs Transformer, Pooling and "
                            "optionally Normalize, in that order (no Dense or other modules)")
    if types[0][1] not in ("", "."):
        raise ArtifactError(f"{modules_path}: the Transformer module must be the directory itself (path \"\"), "
                            f"not {types[0][1]!r}")
    if not types[1][1]:
        raise ArtifactError(f"{modules_path}: the Pooling module needs its own folder (path, e.g. 1_Pooling)")
    pool_path = artifact_path(directory, os.path.join(types[1][1], "config.json"))
    pool = read_json(pool_path, "sentence-transformers Pooling config")
    if not isinstance(pool, dict):
        raise ArtifactError(f"{pool_path}: expected a JSON object")
    on = [MODES[k] for k in MODES if pool.get(k) is True]
    odd = [k for k in UNSUPPORTED_MODES if pool.get(k) is True]
    if odd or len(on) != 1:
        raise ArtifactError(f"{pool_path}: pooling {', '.join(odd + [k for k in MODES if pool.get(k) is True]) or 'none'}: "
                            "this server pools with exactly one of pooling_mode_cls_token, pooling_mode_mean_tokens "
                            "or pooling_mode_lasttoken")
    if pool.get("include_prompt", True) is not True:
        raise ArtifactError(f"{pool_path}: include_prompt false is not supported (every token is pooled)")
    dim = pool.get("word_embedding_dimension", hidden_size)
    if dim != hidden_size:
        raise ArtifactError(f"{pool_path}: word_embedding_dimension {dim!r} differs from the model's hidden size "
                            f"{hidden_size}")
    max_len, lower = None, False
    sbert_path = artifact_path(directory, SBERT_CONFIG)
    if sbert_path.exists():
        sbert = read_json(sbert_path, "sentence-transformers config")
        if not isinstance(sbert, dict):
            raise ArtifactError(f"{sbert_path}: expected a JSON object")
        max_len = sbert.get("max_seq_length")
        if max_len is not None and (not isinstance(max_len, int) or isinstance(max_len, bool) or max_len <= 0):
            raise ArtifactError(f"{sbert_path}: max_seq_length must be a positive integer, not {max_len!r}")
        lower = sbert.get("do_lower_case", False) is True
    return PoolingSpec(mode=on[0], normalize=len(names) == 3, dim=hidden_size, max_seq_length=max_len,
                       do_lower_case=lower, matryoshka=_matryoshka(hf_config, hidden_size))


def _matryoshka(hf_config: dict[str, Any], hidden_size: int) -> tuple[int, ...] | bool:
    dims = hf_config.get("matryoshka_dimensions")
    if isinstance(dims, list) and dims and all(isinstance(d, int) and not isinstance(d, bool) and 0 < d <= hidden_size
                                               for d in dims):
        return tuple(dims)
    return hf_config.get("is_matryoshka") is True
