"""A hybrid checkpoint written by the trainer's own save path (weights, AdamW moments, train state)
survives an offline reshard to TP2 x PP2 x DP2 x EP2 and resumes exactly with the trainer's loader;
each rank's file holds the blocks the hybrid parallel plan gives that rank."""

from __future__ import annotations

import pytest
import torch
from ckpt_helpers import make_tokenizer

trainer_ckpt = pytest.importorskip("tessera.trainer.components.checkpoint.storage")

MODEL = {"kind": "hybrid", "vocab_size": 320, "hidden_size": 32, "num_layers": 4, "pattern": "M*-E",
         "num_heads": 4, "num_kv_heads": 2, "ffn_hidden_size": 48,
         "mamba": {"num_heads": 4, "head_dim": 8, "state_size": 8, "num_groups": 2, "chunk_size": 8},
         "moe": {"num_experts": 4, "top_k": 2, "ffn_hidden_size": 16, "score": "sigmoid", "bias_balancing": True,
                 "num_shared_experts": 1, "shared_ffn_hidden_size": 24}}


def _trained(cfg, seed):
    from tessera.common.models.registry import kind_of

    model = kind_of(cfg).build(cfg, seed=seed)
    opt = torch.optim.AdamW(model.named_parameters(), lr=1e-3)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(seed))
    for _ in range(2):
        loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def test_a_trainer_saved_hybrid_checkpoint_reshards_to_tp2_pp2_dp2_ep2_and_resumes_exactly(tmp_path):
    import torch.distributed.checkpoint as dcp

    from tessera.ckpt_convert.cli import run
    from tessera.common.checkpoint import CheckpointSidecar, read_sidecar, resolve_checkpoint
    from tessera.common.models.registry import model_config
    from tessera.common.tokenizer import load_tokenizer
    from tessera.trainer.components.precision.mixed import Precision

    cfg = model_config(MODEL)
    model, opt = _trained(cfg, seed=0)
    tok = load_tokenizer(make_tokenizer(tmp_path / "tok"))
    precision = Precision("fp32", torch.device("cpu"))
    state = trainer_ckpt.TrainState(step=2, consumed_samples=4, consumed_tokens=64)
    trainer_ckpt.save_checkpoint(tmp_path / "ckpts", model, opt, precision, state,
                                 CheckpointSidecar(model=cfg, tokenizer_fingerprint=tok.fingerprint), tok, keep_last=2)
    assert run(["reshard", "--checkpoint", str(tmp_path / "ckpts"), "--output", str(tmp_path / "resharded"),
                "--tensor-parallel", "2", "--pipeline-parallel", "2", "--data-parallel", "2", "--expert-parallel", "2",
                "--quiet"]) == 0
    directory = resolve_checkpoint(tmp_path / "resharded")
    assert len(list(directory.glob("*.distcp"))) == 16 and read_sidecar(directory).layout.world_size == 16
    # Rank = tp + 2 * (ep + 2 * (dp + 2 * pp)). Layer 0 (M) is on pipeline rank 0: tensor rank 1 (rank 1)
    # holds the second group's B rows; its Adam moments are split again over the dp x ep replicas.
    # Layer 3 (E) is on pipeline rank 1: expert rank 1 of it (rank 8 + 2) holds experts 2 and 3.
    meta = dcp.FileSystemReader(str(directory)).read_metadata()
    where = {(k.fqn, tuple(k.offset)): v.relative_path for k, v in meta.storage_data.items() if k.offset is not None}
    assert where[("model.layers.0.mixer.in_proj.b.weight", (8, 0))] == "__1_0.distcp"
    assert where[("model.layers.0.mixer.out_proj.weight", (0, 16))] == "__1_0.distcp"
    assert where[("model.layers.3.mixer.experts.up_proj", (2, 0, 0))] == "__10_0.distcp"
    moments = sorted(off for (fqn, off) in where if fqn.endswith("layers.0.mixer.in_proj.x.weight.exp_avg"))
    assert len(moments) == 2 * 4  # 2 tensor ranks x 4 data x expert replicas

    fresh, fresh_opt = _trained(cfg, seed=1)  # different weights and moments, overwritten by the load
    got_state, _ = trainer_ckpt.load_checkpoint(directory, fresh, fresh_opt, precision)
    assert got_state == state
    for (name, p), (_, q) in zip(model.named_parameters(), fresh.named_parameters()):
        assert torch.equal(p, q), name
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[p][key], fresh_opt.state[q][key]), (name, key)
    for (name, b), (_, c) in zip(model.named_buffers(), fresh.named_buffers()):
        assert torch.equal(b, c), name
