"""Serving Hugging Face directories written by transformers 5 itself (random tiny models built
at test time): greedy generations equal transformers' `generate`, chat reads chat_template.jinja,
and `tessera-ckpt import` reads each directory into the same ModelConfig as the server."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
import torch
from inference_helpers import CHAT_TEMPLATE, hf_greedy, make_engine, run_all, token_ids, wait_for_health
from ports import SERVE, start_serve

from tessera.common.checkpoint import resolve_checkpoint
from tessera.inference.core.sampling_params import SamplingParams

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
PROMPT = [4, 9, 200, 31, 77, 5, 6, 7, 8, 120, 3]


def _llama(**over):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=4, max_position_embeddings=256, bos_token_id=None, eos_token_id=None,
               pad_token_id=None)
    cfg.update(over)
    return _separated(LlamaForCausalLM(LlamaConfig(**cfg)))


def _gpt2(**over):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = dict(vocab_size=512, n_embd=64, n_layer=2, n_head=4, n_positions=128, bos_token_id=None,
               eos_token_id=None)
    cfg.update(over)
    return _separated(GPT2LMHeadModel(GPT2Config(**cfg)))


def _separated(hf):
    """Random biases (transformers initialises them to zero, which would hide a dropped bias); a
    scaled head, so greedy choices are well separated (no ties decided by float rounding); and
    sharp attention (queries and keys x10), so that positions matter: at the init scale a wrong
    RoPE theta or scaling still gives the same tokens (seen)."""
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(".bias") and "ln" not in name and "norm" not in name:
                p.normal_(0.0, 0.2)
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(10.0)
        hf.get_output_embeddings().weight.mul_(20.0)
    return hf.eval()


def _save(hf, tiny_ckpt, out, chat_template_file: bool = False):
    """The model as transformers saves it, plus the tiny tokenizer (its chat template moved to
    chat_template.jinja, as current transformers writes it, when asked)."""
    hf.save_pretrained(out)
    tok_dir = resolve_checkpoint(tiny_ckpt) / "tokenizer"
    shutil.copy(tok_dir / "tokenizer.json", out / "tokenizer.json")
    tok_cfg = json.loads((tok_dir / "tokenizer_config.json").read_text())
    if chat_template_file:
        (out / "chat_template.jinja").write_text(tok_cfg.pop("chat_template"))
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    return out


CASES = {
    "llama-transformers5-rope-parameters-llama3": lambda: _llama(rope_parameters=LLAMA3_ROPE),
    "gpt2-untied": lambda: _gpt2(tie_word_embeddings=False),
    "llama-attention-and-mlp-biases": lambda: _llama(attention_bias=True, mlp_bias=True),
    "llama-gqa": lambda: _llama(num_key_value_heads=2),
}


@pytest.mark.parametrize("name", list(CASES))
def test_hf_directory_is_served_token_for_token_like_transformers(tiny_ckpt, tmp_path, name):
    hf = CASES[name]()
    export = _save(hf, tiny_ckpt, tmp_path / "hf")
    engine = make_engine(export, num_kv_blocks=64, block_size=8)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    out = run_all(engine, {"a": (PROMPT, params)})["a"]
    assert token_ids(out) == hf_greedy(hf, PROMPT, 12)


@pytest.mark.parametrize("name", list(CASES))
def test_ckpt_import_and_serve_read_the_same_model_config(tiny_ckpt, tmp_path, name):
    from tessera.ckpt_convert.cli import run
    from tessera.common.checkpoint import load_model_tensors, read_sidecar
    from tessera.inference.worker.loader import load_for_serving

    export = _save(CASES[name](), tiny_ckpt, tmp_path / "hf")
    served = load_for_serving(export, torch.device("cpu"), torch.float32)
    assert run(["import", "--format", "hf", "--input", str(export), "--output", str(tmp_path / "ck"), "--quiet"]) == 0
    imported = resolve_checkpoint(tmp_path / "ck")
    assert read_sidecar(imported).model == served.config
    tensors = load_model_tensors(imported)
    assert all(torch.equal(tensors[k], v) for k, v in served.model.state_dict().items())


def test_served_llama3_rope_is_not_the_default_rope(tiny_ckpt, tmp_path):
    """The rope_parameters case above can fail: read as the default RoPE (theta 10000, no
    scaling, what the server used to do), or with the right theta but no scaling, the same
    weights generate other tokens."""
    from tessera.inference.worker.loader import load_for_serving

    hf = _llama(rope_parameters=LLAMA3_ROPE)
    export = _save(hf, tiny_ckpt, tmp_path / "hf")
    cfg = load_for_serving(export, torch.device("cpu"), torch.float32).config
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling is not None and cfg.rope_scaling.factor == 8.0
    right = hf_greedy(hf, PROMPT, 12)
    assert hf_greedy(_llama(), PROMPT, 12) != right  # same seed, same weights, default RoPE
    assert hf_greedy(_llama(rope_parameters={"rope_type": "default", "rope_theta": 500000.0}), PROMPT, 12) != right


@pytest.mark.slow
def test_serve_chat_reads_chat_template_jinja(tiny_ckpt, tmp_path):
    """The real `tessera-serve` on a directory whose chat template exists only as
    chat_template.jinja: chat renders it as transformers does and answers greedily as transformers."""
    import httpx
    from transformers import AutoTokenizer

    hf = _llama(num_key_value_heads=2)
    export = _save(hf, tiny_ckpt, tmp_path / "hf", chat_template_file=True)
    assert "chat_template" not in json.loads((export / "tokenizer_config.json").read_text())
    messages = [{"role": "user", "content": "def parse(text):"}]
    tok = AutoTokenizer.from_pretrained(export)
    assert tok.chat_template == CHAT_TEMPLATE
    prompt = tok(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                 add_special_tokens=False)["input_ids"]
    expected = tok.decode(hf_greedy(hf, prompt, 8), skip_special_tokens=True)

    proc, url, _ = start_serve(SERVE, "--checkpoint", export, "--quiet", "--num-kv-blocks", "64")
    try:
        wait_for_health(proc, url, 120)
        r = httpx.post(url + "/v1/chat/completions", json={"messages": messages, "max_tokens": 8, "temperature": 0,
                                                           "ignore_eos": True}, timeout=60)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"]["prompt_tokens"] == len(prompt)
        assert body["choices"][0]["message"]["content"] == expected
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
