"""The Hugging Face adapter (tessera.common.hf): config.json in every spelling transformers has
written, and the refusals shared by `tessera-ckpt import` and the server (one line naming the
file and field, exit 2, nothing written)."""

from __future__ import annotations

import json

import pytest
import torch

from tessera.common.errors import ArtifactError
from tessera.common.hf.directory import read_hf_config
from tessera.common.models.causal_lm.config import ModelConfig
from tessera.common.models.causal_lm.hf.adapter import ARCHITECTURES, hf_config
from tessera.common.models.registry import model_config_from_hf

LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 32}


def _llama_dir(path, **over):
    """A tiny LlamaForCausalLM saved by transformers itself (config.json + model.safetensors)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64)
    cfg.update(over)
    LlamaForCausalLM(LlamaConfig(**cfg)).save_pretrained(path)
    return path


def _edit_config(path, **fields):
    config = json.loads((path / "config.json").read_text())
    config.update(fields)
    (path / "config.json").write_text(json.dumps(config))


def _import_error(hf, out, capsys) -> str:
    """`tessera-ckpt import` of `hf`: exits 2 with one stderr line, which is returned; no output."""
    from tessera.ckpt_convert.cli import main

    capsys.readouterr()  # drop transformers' progress output from building the directory
    with pytest.raises(SystemExit) as exc:
        main(["import", "--format", "hf", "--input", str(hf), "--output", str(out), "--quiet"])
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and len(err.splitlines()) == 1, err
    assert not out.exists()
    return err


def test_transformers5_rope_parameters_and_older_top_level_rope_read_the_same(tmp_path):
    from transformers import LlamaConfig

    new = json.loads((_llama_dir(tmp_path / "new", rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0,
                                                                      **LLAMA3}) / "config.json").read_text())
    assert "rope_parameters" in new and "rope_theta" not in new  # what transformers 5 writes
    old = {k: v for k, v in new.items() if k != "rope_parameters"}
    old.update(rope_theta=500000.0, rope_scaling={"type": "llama3", **LLAMA3})  # transformers 4.x spelling
    a, b = model_config_from_hf(new, "new/config.json"), model_config_from_hf(old, "old/config.json")
    assert a == b and a.rope_theta == 500000.0 and a.rope_scaling.model_dump() == {"rope_type": "llama3", **LLAMA3}
    # Both present and disagreeing: rope_parameters wins, as in transformers 5 itself.
    both = {**new, "rope_theta": 10000.0}
    assert model_config_from_hf(both, "both").rope_theta == LlamaConfig(**both).rope_parameters["rope_theta"] == 500000.0


@pytest.mark.parametrize("cfg", [
    ModelConfig(arch="llama", vocab_size=128, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                ffn_hidden_size=96, rope_theta=500000.0, rope_scaling=LLAMA3, bias=True),
    ModelConfig(arch="gpt2", vocab_size=128, hidden_size=64, num_layers=2, num_heads=4, ffn_hidden_size=256,
                norm="layernorm", activation="gelu", position="learned", bias=True, tie_embeddings=False),
], ids=["llama", "gpt2"])
def test_config_round_trips_through_config_json_and_transformers_reads_it(cfg):
    from transformers import AutoConfig

    data = hf_config(cfg, torch.float32, None, None)
    assert model_config_from_hf(data, "config.json") == cfg
    theirs = AutoConfig.for_model(**data)
    assert theirs.tie_word_embeddings == cfg.tie_embeddings
    if cfg.arch == "llama":
        assert theirs.rope_parameters == {"rope_type": "llama3", "rope_theta": 500000.0, **LLAMA3}
        assert theirs.attention_bias and theirs.mlp_bias and theirs.num_key_value_heads == 2


def test_every_architecture_maps_both_ways_in_one_place():
    """The registry is the one list: each entry names its transformers class and has both mappings."""
    from tessera.common.hf.architecture import HFArchitecture

    assert {a.model_type: a.hf_class for a in ARCHITECTURES} == {
        "llama": "LlamaForCausalLM", "gpt2": "GPT2LMHeadModel", "mistral": "MistralForCausalLM",
        "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "mixtral": "MixtralForCausalLM",
        "qwen3_moe": "Qwen3MoeForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}
    for a in ARCHITECTURES:
        for method in ("config_fields", "hf_fields", "check_exportable", "export_rules", "import_rules"):
            assert getattr(type(a), method) is not getattr(HFArchitecture, method), (a.model_type, method)


BAD_CONFIGS = {
    "string-number": ({"hidden_size": "64"}, "field 'hidden_size' must be a positive integer, got '64'"),
    "zero-heads": ({"num_attention_heads": 0}, "field 'num_attention_heads' must be a positive integer, got 0"),
    "unsupported-type": ({"model_type": "falcon", "architectures": ["FalconForCausalLM"]},
                         "unsupported architecture 'falcon' (FalconForCausalLM)"),
    "longrope": ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "factor": 4.0}},
                 "field 'rope_type' = 'longrope' is not supported"),
    "gelu-llama": ({"hidden_act": "gelu"}, "field 'hidden_act' = 'gelu' is not supported"),
    "odd-head-dim": ({"head_dim": 7}, "RoPE needs an even head dimension, got 7"),
    "indivisible-kv": ({"num_key_value_heads": 3}, "num_kv_heads (3) must divide num_heads (4)"),
}


@pytest.mark.parametrize("name", list(BAD_CONFIGS))
def test_malformed_config_json_is_one_line_naming_the_field_in_import_and_serve(tmp_path, capsys, name):
    from tessera.inference.worker.loader import load_for_serving

    fields, message = BAD_CONFIGS[name]
    hf = _llama_dir(tmp_path / "hf")
    _edit_config(hf, **fields)
    err = _import_error(hf, tmp_path / "out", capsys)
    assert "config.json" in err and message in err, err
    with pytest.raises(ArtifactError, match="config.json") as served:
        load_for_serving(hf, torch.device("cpu"), torch.float32)
    assert message in str(served.value)


def test_int8_weights_are_refused_not_cast(tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    from tessera.inference.worker.loader import load_for_serving

    hf = _llama_dir(tmp_path / "hf")
    tensors = load_file(hf / "model.safetensors")
    name = "model.layers.0.mlp.up_proj.weight"
    tensors[name] = tensors[name].to(torch.int8)
    save_file(tensors, hf / "model.safetensors", metadata={"format": "pt"})
    assert f"{name!r} is int8" in _import_error(hf, tmp_path / "out", capsys)
    with pytest.raises(ArtifactError, match=f"{name!r} is int8"):
        load_for_serving(hf, torch.device("cpu"), torch.float32)


def test_weights_the_config_does_not_describe_are_refused(tmp_path):
    """Biases in the weights but not in config.json: dropping them silently would serve another model."""
    from tessera.inference.worker.loader import load_for_serving

    hf = _llama_dir(tmp_path / "hf", attention_bias=True, mlp_bias=True)
    _edit_config(hf, attention_bias=False, mlp_bias=False)
    with pytest.raises(ArtifactError, match=r"'model.layers.0.\S+.bias' is not part of the model config.json describes"):
        load_for_serving(hf, torch.device("cpu"), torch.float32)


def test_pickled_bin_weights_are_refused_with_the_way_out(tmp_path, capsys):
    from tessera.inference.worker.loader import load_for_serving

    hf = _llama_dir(tmp_path / "hf")
    (hf / "model.safetensors").unlink()
    (hf / "pytorch_model.bin").write_bytes(b"never unpickled")
    assert "safe_serialization=True" in _import_error(hf, tmp_path / "out", capsys)
    with pytest.raises(ArtifactError, match="convert them"):
        load_for_serving(hf, torch.device("cpu"), torch.float32)


def test_read_hf_config_returns_the_raw_json_too(tmp_path):
    hf = _llama_dir(tmp_path / "hf", eos_token_id=[5, 7])
    cfg, raw = read_hf_config(hf)
    assert cfg.num_kv_heads == 2 and raw["eos_token_id"] == [5, 7]


def test_chat_template_jinja_wins_over_tokenizer_config_as_in_transformers(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoTokenizer

    from tessera.common.tokenizer import load_tokenizer

    tok = Tokenizer(models.WordLevel({"a": 0, "b": 1, "<e>": 2, "<unk>": 3}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<e>", "chat_template": "old {{ messages }}", "tokenizer_class": "PreTrainedTokenizerFast"}))
    assert load_tokenizer(tmp_path).chat_template == AutoTokenizer.from_pretrained(tmp_path).chat_template
    (tmp_path / "chat_template.jinja").write_text("new {{ messages }}")
    ours, theirs = load_tokenizer(tmp_path).chat_template, AutoTokenizer.from_pretrained(tmp_path).chat_template
    assert ours == theirs == "new {{ messages }}"
