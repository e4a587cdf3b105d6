"""Fixtures: a tiny Llama checkpoint (random weights) with a BPE tokenizer trained in tmp."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from tessera.common.checkpoint import (
    CheckpointSidecar,
    finalize_checkpoint,
    save_model_tensors,
    write_pointer,
)
from tessera.common.models.causal_lm.config import ModelConfig
from tessera.common.models.causal_lm.model import build_model

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def corpus() -> list[str]:
    import inspect
    import json as _json
    import textwrap

    # Real text from the standard library's own sources: small, present everywhere.
    return [inspect.getsource(m) for m in (textwrap, _json.decoder, _json.encoder)]


def train_tokenizer(directory: Path, vocab_size: int = 512) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|bos|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(), trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|endoftext|>", "bos_token": "<|bos|>", "chat_template": CHAT_TEMPLATE,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }))


def tiny_config(**over) -> ModelConfig:
    base = dict(arch="llama", vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                ffn_hidden_size=128, max_seq_len=256)
    base.update(over)
    return ModelConfig(**base)


def make_checkpoint(root: Path, cfg: ModelConfig, seed: int = 0, tokenizer_vocab: int = 512) -> Path:
    """A complete Tessera checkpoint: run/checkpoints/iter_0000001 + pointer + tokenizer."""
    model = build_model(cfg, seed=seed)
    # Random init gives near-uniform logits; scale the head so greedy choices are well separated
    # (ties would make token-for-token parity depend on float rounding).
    with torch.no_grad():
        model.output_weight().mul_(20.0)
    ckpt_root = root / "checkpoints"
    it = ckpt_root / "iter_0000001"
    it.mkdir(parents=True)
    save_model_tensors(it, {k: v.detach().clone() for k, v in model.state_dict().items()})
    train_tokenizer(it / "tokenizer", tokenizer_vocab)
    finalize_checkpoint(it, CheckpointSidecar(model=cfg, step=1))
    write_pointer(ckpt_root, 1)
    return root


def hf_llama_from(model_cfg: ModelConfig, tensors: dict[str, torch.Tensor]):
    """transformers' LlamaForCausalLM holding our weights (names mapped by hand, as the brief says)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    c = model_cfg
    hf = LlamaForCausalLM(LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.ffn_hidden_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads, num_key_value_heads=c.kv_heads,
        max_position_embeddings=c.max_seq_len, rms_norm_eps=c.norm_eps, rope_theta=c.rope_theta,
        tie_word_embeddings=c.tie_embeddings, bos_token_id=None, eos_token_id=None, pad_token_id=None,
        attn_implementation="eager"))
    state = {}
    for name, t in tensors.items():
        n = name.replace("layers.", "model.layers.").replace(".attn.", ".self_attn.")
        n = n.replace("attn_norm", "input_layernorm").replace("mlp_norm", "post_attention_layernorm")
        n = {"embed_tokens.weight": "model.embed_tokens.weight", "final_norm.weight": "model.norm.weight"}.get(n, n)
        state[n] = t
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    return hf.eval()


def hf_greedy(hf, prompt: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def make_engine(ckpt: Path, **cfg):
    from tessera.inference.config import EngineConfig
    from tessera.inference.engine.llm_engine import LLMEngine
    from tessera.inference.worker.loader import load_for_serving

    # As tessera-serve loads: under tensor parallel the loader reads no weights (the workers do).
    loaded = load_for_serving(ckpt, torch.device("cpu"), torch.float32, tensor_parallel=cfg.get("tensor_parallel", 1),
                              generation_config=cfg.get("generation_config", "auto"))
    return LLMEngine(loaded, EngineConfig(**cfg), torch.device("cpu"), torch.float32)


def assert_kv_and_drafter_caches_fill_the_budget(engine, budget: int) -> None:
    """The target's KV pool and the speculative drafter's cache (as many blocks) together take at most
    `budget` bytes, and less than one block pair short of it."""
    def nbytes(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    target, drafter = nbytes(engine.runner.kv), nbytes(engine.proposer.runner.kv)
    blocks = engine.runner.num_blocks
    assert engine.proposer.runner.num_blocks == blocks
    assert target + drafter <= budget < target + drafter + (target + drafter) // blocks, (target, drafter, budget)


def run_all(engine, requests: dict[str, tuple[list[int], object]]) -> dict[str, list]:
    """Add every request, step to completion; returns request id -> list of outputs."""
    outs: dict[str, list] = {rid: [] for rid in requests}
    for rid, (ids, params) in requests.items():
        engine.add_request(rid, ids, params)
    engine.run_to_completion(lambda o: outs[o.request_id].append(o))
    return outs


def token_ids(outputs: list) -> list[int]:
    return [t for o in outputs for t in o.new_token_ids]


def wait_for_health(proc, url: str, timeout: float) -> None:
    """Poll a `tessera-serve` subprocess's /health until 200; fail with its stderr if it exits first."""
    import time

    import httpx

    deadline = time.time() + timeout
    while True:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.time() < deadline and proc.poll() is None, proc.stderr.read() if proc.poll() else "timeout"
        time.sleep(0.2)


def generate_usage_error(argv, capsys) -> str:
    """`tessera-generate argv` must exit 2 with exactly one line on stderr, no traceback: that line."""
    import pytest

    from tessera.common.errors import run_cli
    from tessera.inference.entrypoints.generate_cli import main

    with pytest.raises(SystemExit) as exc:
        run_cli(main, [str(a) for a in argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    return err[0]


def assert_alive_and_drained(client, frontend, engine, drain_s: float = 30) -> None:
    """After a barrage of requests: the engine is healthy, answers an ordinary completion, and
    every request has ended with its KV blocks freed."""
    assert frontend.healthy and client.get("/health").status_code == 200
    # ignore_eos: a sampled end-of-text may end it early (seen on a tiny model whose eos is a common id)
    ok = client.post("/v1/completions", json={"prompt": "def f(x):", "max_tokens": 4, "temperature": 1.0,
                                              "ignore_eos": True})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
    deadline = time.monotonic() + drain_s
    while (engine.blocks.num_used or frontend.num_active()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.blocks.num_used == 0 and frontend.num_active() == 0


def check_alone_then_concurrent_greedy(server, prompts: list[list[int]], expected: list[list[int]], tokenizer,
                                       max_tokens: int, first: int = 0) -> None:
    """Over HTTP: prompt `first` alone, then every prompt at once (one thread each); each reply's
    text is its expected greedy tokens', some sequences were preempted (the callers size the KV
    pool below what runs), and every block came back."""
    import concurrent.futures as cf

    import httpx

    body = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    one = httpx.post(f"{server.url}/v1/completions", json={**body, "prompt": prompts[first]}, timeout=60)
    assert one.status_code == 200, one.text
    assert one.json()["choices"][0]["text"] == tokenizer.decode(expected[first])
    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        futs = [pool.submit(httpx.post, f"{server.url}/v1/completions", json={**body, "prompt": p}, timeout=120)
                for p in prompts]
        replies = [f.result() for f in futs]
    for prompt, reply, want in zip(prompts, replies, expected):
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["text"] == tokenizer.decode(want), prompt
    assert server.engine.scheduler.num_preemptions > 0
    assert server.wait_idle()  # every block came back
