"""Helpers for the ckpt_convert tests: tiny tokenizers and tiny random checkpoints, built in tmp
dirs (nothing downloaded). A uniquely named module, not conftest, so that importing it from the
tests cannot pick up another directory's conftest when the whole suite is collected."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tessera.common.checkpoint import (
    CheckpointSidecar,
    finalize_checkpoint,
    iter_dir_name,
    save_model_tensors,
    write_pointer,
)
from tessera.common.layout import ParallelLayout
from tessera.common.models.causal_lm.config import ModelConfig
from tessera.common.models.registry import kind_of
from tessera.common.tokenizer import tokenizer_fingerprint

CHAT_TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"


def make_tokenizer(directory: Path, vocab_size: int = 300) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    directory.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|bos|>", "<|eos|>", "<|pad|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = [f"def f{i}(x):\n    return x * {i} + {i * i}  # line {i}" for i in range(400)]
    tok.train_from_iterator(text, trainer)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|bos|>", "eos_token": "<|eos|>", "pad_token": "<|pad|>",
        "chat_template": CHAT_TEMPLATE, "model_max_length": 256,
    }))
    return directory


def make_checkpoint(root: Path, cfg: Any, tokenizer: Path | None, step: int = 10, seed: int = 0,
                    extra: dict[str, torch.Tensor] | None = None) -> Path:
    """A run-style checkpoints directory: root/iter_NNNNNNN/ (DCP + sidecar + tokenizer) + pointer,
    for a model config of any kind."""
    model = kind_of(cfg).build(cfg, seed=seed)
    # Random (not init-pattern) norms and biases so a mix-up of any two tensors shows in logits.
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen) if "norm" in name
                        else 0.02 * torch.randn(p.shape, generator=gen))
    directory = root / iter_dir_name(step)
    tensors = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if extra:
        import torch.distributed.checkpoint as dcp

        dcp.save({**{"model." + k: v for k, v in tensors.items()}, **extra}, checkpoint_id=str(directory),
                 no_dist=True)
    else:
        save_model_tensors(directory, tensors)
    fp = None
    if tokenizer is not None:
        import shutil

        shutil.copytree(tokenizer, directory / "tokenizer")
        fp = tokenizer_fingerprint(tokenizer)
    sidecar = CheckpointSidecar(model=cfg, tokenizer_fingerprint=fp, layout=ParallelLayout(), step=step,
                                consumed_samples=step * 8, consumed_tokens=step * 8 * 64,
                                contents=["model"] + sorted({k.split(".")[0] for k in (extra or {})}))
    finalize_checkpoint(directory, sidecar)
    write_pointer(root, step)
    return root


def tiny_llama(**overrides) -> ModelConfig:
    base = dict(arch="llama", vocab_size=320, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2,
                ffn_hidden_size=96, max_seq_len=128, rope_theta=500000.0)
    return ModelConfig(**{**base, **overrides})


def tiny_gpt2(**overrides) -> ModelConfig:
    base = dict(arch="gpt2", vocab_size=320, hidden_size=64, num_layers=2, num_heads=4, ffn_hidden_size=256,
                max_seq_len=64, norm="layernorm", activation="gelu", position="learned", bias=True,
                tie_embeddings=True)
    return ModelConfig(**{**base, **overrides})


def refused(capsys, argv: list[str]) -> str:
    """`tessera-ckpt argv` exits 2 with one line on stderr; returns that line."""
    from tessera.ckpt_convert.cli import main

    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and len(err.splitlines()) == 1, err
    return err
