"""A checkpoint written by the trainer's own save path survives reshard and resumes exactly.

Uses tessera.trainer.components.checkpoint.storage (tests may import any package): save after two AdamW steps,
reshard to tp2/pp2/dp2, load into a fresh model and optimizer with the trainer's loader, and check
weights, both Adam moments, step counters and the train state all match the original.
"""

from __future__ import annotations

import pytest
import torch
from ckpt_helpers import make_tokenizer, tiny_llama

trainer_ckpt = pytest.importorskip("tessera.trainer.components.checkpoint.storage")


def _trained(cfg, seed):
    from tessera.common.models.causal_lm.model import build_model

    model = build_model(cfg, seed=seed)
    opt = torch.optim.AdamW(model.named_parameters(), lr=1e-3)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(seed))
    for _ in range(2):
        loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def test_trainer_checkpoint_reshard_and_resume(tmp_path):
    from tessera.ckpt_convert.cli import run
    from tessera.common.checkpoint import CheckpointSidecar, read_sidecar, resolve_checkpoint
    from tessera.common.tokenizer import load_tokenizer
    from tessera.trainer.components.precision.mixed import Precision

    cfg = tiny_llama(num_layers=2, num_kv_heads=2)
    model, opt = _trained(cfg, seed=0)
    tok = load_tokenizer(make_tokenizer(tmp_path / "tok"))
    precision = Precision("fp32", torch.device("cpu"))
    state = trainer_ckpt.TrainState(step=2, consumed_samples=4, consumed_tokens=64)
    trainer_ckpt.save_checkpoint(tmp_path / "ckpts", model, opt, precision, state,
                                 CheckpointSidecar(model=cfg, tokenizer_fingerprint=tok.fingerprint), tok, keep_last=2)

    assert run(["reshard", "--checkpoint", str(tmp_path / "ckpts"), "--output", str(tmp_path / "resharded"),
                "--tensor-parallel", "2", "--pipeline-parallel", "2", "--data-parallel", "2", "--quiet"]) == 0
    directory = resolve_checkpoint(tmp_path / "resharded")
    assert len(list(directory.glob("*.distcp"))) == 8 and read_sidecar(directory).layout.world_size == 8

    fresh, fresh_opt = _trained(cfg, seed=1)  # different weights and moments, overwritten by the load
    got_state, _ = trainer_ckpt.load_checkpoint(directory, fresh, fresh_opt, precision)
    assert got_state == state
    for (name, p), (_, q) in zip(model.named_parameters(), fresh.named_parameters()):
        assert torch.equal(p, q), name
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[p][key], fresh_opt.state[q][key]), (name, key)
