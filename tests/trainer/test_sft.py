"""Supervised fine-tuning: chat data prepared with a loss mask (tessera-data prep --format chat)
trains on its answer tokens only. The loss equals a hand computation over the answer tokens, found
independently from the token stream (after <|assistant|>, through <|end|>, and the end-of-document
token closing an answer); and a tiny model learns the answers' fixed format."""

from __future__ import annotations

import json

import numpy as np
import torch
import torch.nn.functional as F
import yaml
from sft_fixtures import FORMAT, prep_chat_mixture

from tessera.common.checkpoint import load_model_tensors, read_sidecar, resolve_checkpoint
from tessera.common.mixture import MixtureSplit
from tessera.common.models.causal_lm.config import ModelConfig
from tessera.common.models.causal_lm.model import build_model
from tessera.common.tokenizer import load_tokenizer
from tessera.trainer.cli import main
from tessera.trainer.components.optimizer.optim import build_optimizer
from tessera.trainer.components.precision.mixed import Precision
from tessera.trainer.config import OptimConfig
from tessera.trainer.objectives.batches import MixtureBatches
from tessera.trainer.objectives.documents import DocumentMasking
from tessera.trainer.objectives.step import TrainStep

CPU = torch.device("cpu")


def answer_mask(tokens: np.ndarray, tok) -> np.ndarray:
    """1 on the tokens of assistant answers, by reading the stream: everything after <|assistant|>
    through the next <|end|>, and the eos right after an answer's <|end|>."""
    assistant, end, eos = (tok.token_id(t) for t in ("<|assistant|>", "<|end|>", "<|eos|>"))
    mask, inside, closed_answer = np.zeros(len(tokens), dtype=np.int64), False, False
    for i, t in enumerate(tokens):
        if inside:
            mask[i] = 1
            if t == end:
                inside, closed_answer = False, True
            continue
        mask[i] = 1 if (t == eos and closed_answer) else 0
        closed_answer = False
        inside = t == assistant
    return mask


def test_loss_is_the_hand_computed_mean_over_answer_tokens_only(tmp_path):
    tok_dir, mix = prep_chat_mixture(tmp_path)
    tok = load_tokenizer(tok_dir)
    split = MixtureSplit(mix, "train")
    assert split.has_loss_mask
    # The whole shard's stored mask is the answer mask read off its tokens.
    prefix = tmp_path / "sft_messages_document"
    stored = np.fromfile(f"{prefix}.mask.bin", dtype=np.uint8)
    tokens = np.fromfile(f"{prefix}.bin", dtype=np.uint16)
    assert np.array_equal(stored, answer_mask(tokens, tok)) and 0 < stored.mean() < 0.6
    # Samples that start outside an answer (so the stream reading starts in the right state).
    ids = np.array([n for n in range(64) if split.loss_mask(n)[0] == 0][:6])
    documents = DocumentMasking(None, loss_mask=True)
    inputs, labels = MixtureBatches(split, 32, documents).batch(ids)
    hand = torch.from_numpy(np.stack([answer_mask(split[int(n)], tok) for n in ids]))[:, 1:].bool()
    cfg = ModelConfig(vocab_size=tok.vocab_size, hidden_size=32, num_layers=2, num_heads=4, ffn_hidden_size=64,
                      max_seq_len=64)
    model = build_model(cfg, seed=0)
    with torch.no_grad():
        logp = F.log_softmax(model(inputs).float(), dim=-1)
        targets = torch.cat([inputs[:, 1:], torch.from_numpy(np.stack([split[int(n)][32] for n in ids]))[:, None]],
                            dim=1)
        picked = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        want = -(picked[hand]).mean()
        step = TrainStep(model, build_optimizer(model, OptimConfig(lr=1e-3)), Precision("fp32", CPU), 1.0,
                         documents=documents)
        assert step.per_token_loss
        got = step.loss(inputs, labels, reduction="sum") / (labels != -100).sum()
    assert int((labels != -100).sum()) == int(hand.sum()) > 0
    assert torch.allclose(got, want, rtol=1e-6), (got, want)


def test_chat_fine_tune_learns_the_answer_format(tmp_path):
    tok_dir, mix = prep_chat_mixture(tmp_path)
    config = {
        "run_dir": str(tmp_path / "run"),
        "model": {"arch": "llama", "hidden_size": 64, "num_layers": 2, "num_heads": 4, "ffn_hidden_size": 128,
                  "max_seq_len": 64},
        "data": {"mixture": str(mix), "tokenizer": str(tok_dir), "reset_attention_mask": True,
                 "reset_position_ids": True, "valid_split": None},
        "optim": {"lr": 3e-3, "min_lr": 3e-4},
        "schedule": {"warmup_steps": 5},
        "training": {"steps": 80, "global_batch_size": 8, "micro_batch_size": 8, "seq_length": 32,
                     "log_interval": 10, "save_interval": 80},
        "logging": {"tensorboard": False},
    }
    path = tmp_path / "sft.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main(["--config", str(path), "--quiet"]) == 0
    losses = [r["loss"] for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
              if r["kind"] == "train"]
    assert losses[-1] < 0.5 * losses[0]
    ckpt = resolve_checkpoint(tmp_path / "run" / "checkpoints")
    model = build_model(read_sidecar(ckpt).model, seed=None)
    model.load_state_dict(load_model_tensors(ckpt))
    tok = load_tokenizer(tok_dir)
    prompt = tok.encode("<|user|>tell me about tiger<|end|><|assistant|>")
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(6):
            ids = torch.cat([ids, model(ids)[:, -1:].argmax(-1)], dim=1)
    assert tok.decode(ids[0, len(prompt):].tolist()).startswith(FORMAT.strip())
