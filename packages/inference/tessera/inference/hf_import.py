"""Reading a Hugging Face export directory (Llama or GPT-2) into Tessera's model names.

The server accepts what `tessera-ckpt export --format hf` writes, and what transformers'
`save_pretrained` writes for LlamaForCausalLM / GPT2LMHeadModel: config.json, model.safetensors
(or shards listed in model.safetensors.index.json) and tokenizer files. The mapping lives here,
inside the inference stage, because stages do not import each other.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from tessera.common.errors import ArtifactError
from tessera.common.model_config import ModelConfig

CONFIG = "config.json"
SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"


def is_hf_directory(path: Path) -> bool:
    return (path / CONFIG).is_file() and ((path / SAFETENSORS).is_file() or (path / SAFETENSORS_INDEX).is_file())


def read_hf_config(directory: Path) -> dict[str, Any]:
    path = directory / CONFIG
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ArtifactError(f"{path}: unreadable Hugging Face config ({exc})") from None
    if not isinstance(data, dict):
        raise ArtifactError(f"{path}: expected a JSON object")
    return data


def model_config_from_hf(hf: dict[str, Any], source: Path) -> ModelConfig:
    """Translate a transformers config.json (llama or gpt2) to a ModelConfig."""
    model_type = hf.get("model_type")
    try:
        if model_type == "llama":
            hidden, heads = hf["hidden_size"], hf["num_attention_heads"]
            if hf.get("head_dim") not in (None, hidden // heads):
                raise ArtifactError(f"{source}: head_dim {hf['head_dim']} != hidden_size/num_attention_heads; not supported")
            scaling = hf.get("rope_scaling")
            if scaling is not None:
                kind = scaling.get("rope_type", scaling.get("type"))
                if kind != "llama3":
                    raise ArtifactError(f"{source}: rope_scaling type {kind!r} is not supported (only llama3)")
                scaling = {k: scaling[k] for k in ("factor", "low_freq_factor", "high_freq_factor",
                                                   "original_max_position_embeddings")}
            if hf.get("attention_bias") or hf.get("mlp_bias"):
                raise ArtifactError(f"{source}: Llama with attention_bias/mlp_bias is not supported")
            act = hf.get("hidden_act", "silu")
            if act != "silu":
                raise ArtifactError(f"{source}: hidden_act {act!r} is not supported (Llama uses silu)")
            return ModelConfig(
                arch="llama", vocab_size=hf["vocab_size"], hidden_size=hidden,
                num_layers=hf["num_hidden_layers"], num_heads=heads,
                num_kv_heads=hf.get("num_key_value_heads") or heads,
                ffn_hidden_size=hf["intermediate_size"],
                max_seq_len=hf.get("max_position_embeddings", 2048),
                norm="rmsnorm", norm_eps=hf.get("rms_norm_eps", 1e-6), activation="swiglu", position="rope",
                rope_theta=hf.get("rope_theta", 10000.0), rope_scaling=scaling,
                tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            )
        if model_type == "gpt2":
            d = hf["n_embd"]
            return ModelConfig(
                arch="gpt2", vocab_size=hf["vocab_size"], hidden_size=d, num_layers=hf["n_layer"],
                num_heads=hf["n_head"], ffn_hidden_size=hf.get("n_inner") or 4 * d,
                max_seq_len=hf.get("n_positions", 1024), norm="layernorm",
                norm_eps=hf.get("layer_norm_epsilon", 1e-5), activation="gelu", position="learned",
                bias=True, tie_embeddings=True,
            )
    except KeyError as exc:
        raise ArtifactError(f"{source}: missing field {exc.args[0]!r}") from None
    except ValueError as exc:  # pydantic validation
        raise ArtifactError(f"{source}: unsupported shape ({str(exc).splitlines()[0]})") from None
    raise ArtifactError(f"{source}: model_type {model_type!r} is not supported (llama or gpt2)")


def _safetensors_files(directory: Path) -> list[Path]:
    index = directory / SAFETENSORS_INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError) as exc:
            raise ArtifactError(f"{index}: unreadable safetensors index ({exc})") from None
        return [directory / name for name in sorted(set(weight_map.values()))]
    return [directory / SAFETENSORS]


def read_hf_tensors(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for path in _safetensors_files(directory):
        if not path.is_file():
            raise ArtifactError(f"{path}: safetensors file missing")
        try:
            tensors.update(load_file(str(path)))
        except Exception as exc:
            raise ArtifactError(f"{path}: not a readable safetensors file ({str(exc).splitlines()[0]})") from None
    return tensors


_LLAMA_LAYER = {
    "self_attn.q_proj": "attn.q_proj", "self_attn.k_proj": "attn.k_proj", "self_attn.v_proj": "attn.v_proj",
    "self_attn.o_proj": "attn.o_proj", "mlp.gate_proj": "mlp.gate_proj", "mlp.up_proj": "mlp.up_proj",
    "mlp.down_proj": "mlp.down_proj", "input_layernorm": "attn_norm", "post_attention_layernorm": "mlp_norm",
}
_LAYER_RE = re.compile(r"^(?:model\.)?layers\.(\d+)\.(.+)\.(weight|bias)$")


def llama_to_tessera(hf: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, t in hf.items():
        if name.endswith("rotary_emb.inv_freq"):
            continue  # a buffer older exports include; we compute it
        m = _LAYER_RE.match(name)
        if m and m.group(2) in _LLAMA_LAYER:
            out[f"layers.{m.group(1)}.{_LLAMA_LAYER[m.group(2)]}.{m.group(3)}"] = t
        elif name in ("model.embed_tokens.weight", "embed_tokens.weight"):
            out["embed_tokens.weight"] = t
        elif name in ("model.norm.weight", "norm.weight"):
            out["final_norm.weight"] = t
        elif name == "lm_head.weight":
            if not cfg.tie_embeddings:
                out["lm_head.weight"] = t
        else:
            raise ArtifactError(f"unexpected tensor {name!r} in the Llama export")
    return out


_GPT2_RE = re.compile(r"^(?:transformer\.)?h\.(\d+)\.(.+)$")


def gpt2_to_tessera(hf: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """GPT-2 uses Conv1D (weight [in, out]) and a fused c_attn; ours are Linear ([out, in]) and split."""
    out: dict[str, torch.Tensor] = {}
    d = cfg.hidden_size
    for name, t in hf.items():
        base = name.removeprefix("transformer.")
        m = _GPT2_RE.match(name)
        if base == "wte.weight":
            out["embed_tokens.weight"] = t
        elif base == "wpe.weight":
            out["pos_embed.weight"] = t
        elif base.startswith("ln_f."):
            out["final_norm." + base.split(".")[-1]] = t
        elif name == "lm_head.weight":
            continue  # tied to wte
        elif m:
            i, rest = m.group(1), m.group(2)
            p = f"layers.{i}."
            if rest in ("attn.bias", "attn.masked_bias"):
                continue  # causal-mask buffers
            if rest.startswith("ln_1."):
                out[p + "attn_norm." + rest.split(".")[-1]] = t
            elif rest.startswith("ln_2."):
                out[p + "mlp_norm." + rest.split(".")[-1]] = t
            elif rest == "attn.c_attn.weight":
                q, k, v = t.t().split(d, dim=0)
                out[p + "attn.q_proj.weight"], out[p + "attn.k_proj.weight"], out[p + "attn.v_proj.weight"] = q, k, v
            elif rest == "attn.c_attn.bias":
                q, k, v = t.split(d)
                out[p + "attn.q_proj.bias"], out[p + "attn.k_proj.bias"], out[p + "attn.v_proj.bias"] = q, k, v
            elif rest in ("attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight"):
                target = {"attn.c_proj": "attn.o_proj", "mlp.c_fc": "mlp.up_proj", "mlp.c_proj": "mlp.down_proj"}
                out[p + target[rest.rsplit(".", 1)[0]] + ".weight"] = t.t()
            elif rest in ("attn.c_proj.bias", "mlp.c_fc.bias", "mlp.c_proj.bias"):
                target = {"attn.c_proj": "attn.o_proj", "mlp.c_fc": "mlp.up_proj", "mlp.c_proj": "mlp.down_proj"}
                out[p + target[rest.rsplit(".", 1)[0]] + ".bias"] = t
            else:
                raise ArtifactError(f"unexpected tensor {name!r} in the GPT-2 export")
        else:
            raise ArtifactError(f"unexpected tensor {name!r} in the GPT-2 export")
    return {k: v.contiguous() for k, v in out.items()}


def load_hf_export(directory: Path) -> tuple[ModelConfig, dict[str, torch.Tensor], list[int]]:
    """(model config, tensors in Tessera names, extra EOS ids from generation_config.json)."""
    hf_cfg = read_hf_config(directory)
    cfg = model_config_from_hf(hf_cfg, directory / CONFIG)
    raw = read_hf_tensors(directory)
    convert = llama_to_tessera if cfg.arch == "llama" else gpt2_to_tessera
    try:
        tensors = convert(raw, cfg)
    except ArtifactError as exc:
        raise ArtifactError(f"{directory}: {exc}") from None
    eos: list[int] = []
    for source in (hf_cfg, _read_optional_json(directory / "generation_config.json")):
        value = source.get("eos_token_id")
        if isinstance(value, int):
            eos.append(value)
        elif isinstance(value, list):
            eos.extend(v for v in value if isinstance(v, int))
    return cfg, tensors, sorted(set(eos))


def _read_optional_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ArtifactError(f"{path}: not valid JSON ({exc})") from None
    return data if isinstance(data, dict) else {}
