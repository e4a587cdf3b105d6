"""HF export: transformers loads the directory and gives our logits (fp32, max abs diff < 1e-4)."""

from __future__ import annotations

import json

import pytest
import torch
from ckpt_helpers import make_checkpoint, tiny_gpt2, tiny_llama

from tessera.ckpt_convert.cli import run
from tessera.common.checkpoint import load_model_tensors, resolve_checkpoint
from tessera.common.models.causal_lm.model import build_model

LLAMA3_SCALING = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=32)

CASES = {
    "llama-gqa-untied-llama3rope": tiny_llama(rope_scaling=LLAMA3_SCALING),
    "llama-mha-tied": tiny_llama(num_kv_heads=None, tie_embeddings=True, rope_theta=10000.0),
    "llama-mqa-bias": tiny_llama(num_kv_heads=1, bias=True, num_layers=2),
    "gpt2-tied": tiny_gpt2(),
    "gpt2-untied": tiny_gpt2(tie_embeddings=False),
}


def ours_logits(ckpt, tokens):
    directory = resolve_checkpoint(ckpt)
    from tessera.common.checkpoint import read_sidecar

    cfg = read_sidecar(directory).model
    model = build_model(cfg, seed=None)
    model.load_state_dict(load_model_tensors(directory), strict=True)
    model.eval()
    with torch.no_grad():
        return model(tokens)


@pytest.mark.parametrize("name", list(CASES))
def test_export_logits_match_transformers(tmp_path, tokenizer_dir, name):
    from transformers import AutoModelForCausalLM

    cfg = CASES[name]
    ckpt = make_checkpoint(tmp_path / "run" / "checkpoints", cfg, tokenizer_dir)
    out = tmp_path / "hf"
    # A small shard limit forces the sharded layout with an index for one of the cases.
    extra = ["--max-shard-size", "100KB"] if name == "llama-mha-tied" else []
    assert run(["export", "--format", "hf", "--checkpoint", str(tmp_path / "run"), "--output", str(out),
                "--quiet", *extra]) == 0
    if extra:
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 1
    else:
        assert (out / "model.safetensors").is_file()
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    hf.eval()
    tokens = torch.randint(0, cfg.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = hf(tokens).logits
    ours = ours_logits(ckpt, tokens)
    assert (theirs - ours).abs().max().item() < 1e-4


def test_export_files_and_config(tmp_path, tokenizer_dir):
    from safetensors import safe_open
    from transformers import AutoTokenizer

    cfg = tiny_llama(rope_scaling=LLAMA3_SCALING, tie_embeddings=True)
    make_checkpoint(tmp_path / "ckpts", cfg, tokenizer_dir)
    out = tmp_path / "hf"
    run(["export", "--format", "hf", "--checkpoint", str(tmp_path / "ckpts"), "--output", str(out),
         "--dtype", "bf16", "--quiet"])
    config = json.loads((out / "config.json").read_text())
    tok = AutoTokenizer.from_pretrained(out)
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["rope_theta"] == 500000.0
    assert config["rope_scaling"] == {"rope_type": "llama3", **LLAMA3_SCALING}
    assert config["tie_word_embeddings"] is True and config["torch_dtype"] == "bfloat16"
    assert config["num_key_value_heads"] == 2 and config["head_dim"] == 16
    assert config["bos_token_id"] == tok.convert_tokens_to_ids("<|bos|>")
    assert config["eos_token_id"] == tok.convert_tokens_to_ids("<|eos|>")
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["eos_token_id"] == config["eos_token_id"]
    assert tok.chat_template and "messages" in tok.chat_template
    with safe_open(out / "model.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert "lm_head.weight" not in f.keys()
        emb = f.get_tensor("model.embed_tokens.weight")
    assert emb.dtype == torch.bfloat16
    ref = load_model_tensors(resolve_checkpoint(tmp_path / "ckpts"), ["embed_tokens.weight"])["embed_tokens.weight"]
    assert torch.equal(emb, ref.to(torch.bfloat16))


def test_chat_template_jinja_survives_import_and_export(tmp_path, tokenizer_dir):
    """A directory saved by current transformers keeps its chat template only in
    chat_template.jinja: import carries it into the checkpoint (where the server reads it) and
    export writes it where transformers reads it."""
    import shutil

    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from tessera.common.tokenizer import load_tokenizer

    hf_dir = tmp_path / "hf"
    LlamaForCausalLM(LlamaConfig(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=4, max_position_embeddings=64)).save_pretrained(hf_dir)
    shutil.copy(tokenizer_dir / "tokenizer.json", hf_dir / "tokenizer.json")
    tok_cfg = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    assert tok_cfg.pop("chat_template") != template
    (hf_dir / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    (hf_dir / "chat_template.jinja").write_text(template)
    assert AutoTokenizer.from_pretrained(hf_dir).chat_template == template

    assert run(["import", "--format", "hf", "--input", str(hf_dir), "--output", str(tmp_path / "ck"), "--quiet"]) == 0
    assert load_tokenizer(resolve_checkpoint(tmp_path / "ck") / "tokenizer").chat_template == template
    assert run(["export", "--format", "hf", "--checkpoint", str(tmp_path / "ck"), "--output", str(tmp_path / "out"),
                "--quiet"]) == 0
    assert AutoTokenizer.from_pretrained(tmp_path / "out").chat_template == template
