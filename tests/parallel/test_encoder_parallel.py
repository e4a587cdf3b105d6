"""The encoder's (BERT's) tensor-parallel plan computes what the whole model does: TP2 and TP2 with
sequence parallel on gloo, fp32, the same weights and padded batch with token types: hidden states,
pooled states, binary and MLM logits (the rank's vocabulary slice), and the gradient of every
parameter the hidden, pooled and binary outputs reach (the rank's slice of the whole one's; a
sequence-parallel partial gradient summed over the tensor group first).

Training under the parallel runtime (the masked-LM objective, tessera.trainer.objectives.mlm.objective): TP2,
TP2+SP, PP2, DP2, DP2 with parallel.overlap_param_gather and FSDP2, each built on the meta device as tessera-train builds it, take the same
losses and reach the same parameters as one process with torch's AdamW after a few optimizer steps.

One torchrun launch runs every layout: this file is also the worker (`torchrun ... this_file out.json`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import objective_parity as parity
import pytest
import torch

MODEL = dict(kind="encoder", vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, ffn_hidden_size=64,
             max_seq_len=16, pooler=True, mlm_head=True, binary_head=True, dropout=0.0, attention_dropout=0.0)
# The split's error over the one process's own fp32 error (objective_parity.relative_error;
# measured: at most 1.7).
TOL = 10.0


@pytest.mark.distributed
def test_bert_under_tp2_and_sp_computes_what_the_whole_model_does_and_trains_under_tp_sp_pp_dp_fsdp_like_one_process(tmp_path):
    errors = parity.launch(__file__, tmp_path / "errors.json")
    training = errors.pop("training")
    assert set(errors) == {"tp2", "tp2_sp"} and all(len(e) > 20 for e in errors.values())
    assert not parity.over(errors, TOL), parity.over(errors, TOL)
    # MLM (+ binary head) training: per-step losses within 1e-5 relative, parameters after the
    # steps within 1e-5 normwise (each rank's shards against the one process's).
    assert set(training) == set(TRAIN_LAYOUTS), training
    assert not parity.over(training, 1e-5), training


# ---- the worker (under torchrun) -------------------------------------------------------------------
def _compare(sp: bool) -> dict[str, float]:
    import copy

    from tessera.common.layout import ParallelLayout
    from tessera.common.models import registry
    from tessera.common.models.encoder.parallelize import parallelize_model
    from tessera.common.parallel.state import build_groups

    groups = build_groups(ParallelLayout(tensor=2))
    cfg = registry.model_config(MODEL)
    whole = registry.kind_of(cfg).build(cfg, seed=0)
    parity.randomize_vectors(whole, 0.5)
    part = parallelize_model(copy.deepcopy(whole), groups, sequence_parallel=sp)
    exact = copy.deepcopy(whole).double()
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, MODEL["vocab_size"], (3, 16), generator=g)
    types = (torch.arange(16) >= 9).long().expand(3, 16)
    mask = torch.ones(3, 16, dtype=torch.long)
    mask[1, 11:] = 0
    w_hidden = torch.randn(3, 16, 32, generator=g)
    w_pooled, w_binary = torch.randn(3, 32, generator=g), torch.randn(3, 2, generator=g)
    rank, world = groups.tp_rank, groups.tp
    errors: dict[str, float] = {}
    outs = {}
    for name, model in (("whole", whole), ("part", part), ("exact", exact)):
        o = model(tokens, types, mask)
        hidden_w = w_hidden.chunk(world, dim=1)[rank] if (sp and model is part) else w_hidden
        loss = ((o.hidden * hidden_w.to(o.hidden.dtype)).sum() + (o.pooled * w_pooled.to(o.pooled.dtype)).sum()
                + (o.binary_logits * w_binary.to(o.pooled.dtype)).sum())
        loss.backward()
        outs[name] = o
    wo, po, ex = outs["whole"], outs["part"], outs["exact"]

    def mine(t: torch.Tensor, seq_dim: int | None = None) -> torch.Tensor:
        """This rank's part of a whole-model tensor (its sequence chunk under SP)."""
        return t.chunk(world, dim=seq_dim)[rank] if (sp and seq_dim is not None) else t

    def check(what: str, got: torch.Tensor, fp32: torch.Tensor, fp64: torch.Tensor) -> None:
        errors[what] = parity.relative_error(got, fp32, fp64)

    check("hidden", po.hidden, mine(wo.hidden, 1), mine(ex.hidden, 1))
    check("pooled", po.pooled, wo.pooled, ex.pooled)
    check("binary logits", po.binary_logits, wo.binary_logits, ex.binary_logits)
    check("mlm logits", po.mlm_logits, mine(wo.mlm_logits, 1).chunk(world, dim=-1)[rank],
          mine(ex.mlm_logits, 1).chunk(world, dim=-1)[rank])
    # The MLM logits' gradient is the vocab-parallel loss's (trainer): none here.
    parity.check_grads(errors, part, whole, exact, groups, untouched=lambda name: name.startswith("mlm_head."))
    return parity.worst_over_ranks(errors)


TRAIN_LAYOUTS = {"tp2": dict(tensor=2), "tp2_sp": dict(tensor=2), "pp2": dict(pipeline=2),
                 "dp2": dict(data=2), "fsdp2": dict(data=2, data_shard=2), "dp2_overlap": dict(data=2)}
TRAIN = dict(steps=3, global_batch=8, micro_batch=2, seq=16)


def _mlm_batch(step: int):
    """An MLM batch of the whole global batch: padded rows, two segments, ~20% labelled positions
    (at least one per row), binary targets."""
    from tessera.trainer.objectives.documents import IGNORE_INDEX
    from tessera.trainer.objectives.mlm.batches import MLMBatch

    b, t = TRAIN["global_batch"], TRAIN["seq"]
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, MODEL["vocab_size"], (b, t), generator=g)
    lengths = torch.randint(t // 2, t + 1, (b,), generator=g)
    padding = (torch.arange(t)[None] < lengths[:, None]).long()
    types = ((torch.arange(t)[None] >= (lengths[:, None] // 2)) & padding.bool()).long()
    picked = (torch.rand(b, t, generator=g) < 0.2) & padding.bool()
    picked[:, 1] = True
    labels = torch.where(picked, torch.randint(0, MODEL["vocab_size"], (b, t), generator=g), IGNORE_INDEX)
    return MLMBatch(tokens, types, padding, torch.randint(0, 2, (b,), generator=g)), labels


def _mlm_loss(model, part, labels):
    from tessera.trainer.objectives.mlm.loss import mlm_loss

    out = model(part.tokens, part.token_types, part.padding_mask)
    return mlm_loss(out, labels, part.binary_labels)


def _main() -> None:
    from tessera.common.parallel.state import destroy_distributed, init_distributed

    torch.set_num_threads(1)
    init_distributed()
    errors = {"tp2": _compare(sp=False), "tp2_sp": _compare(sp=True)}
    from tessera.common.models import registry

    cfg = registry.model_config(MODEL)
    reference = parity.reference_training(registry.kind_of(cfg).build(cfg, seed=0), _mlm_batch, _mlm_loss, TRAIN)
    errors["training"] = {name: parity.train_parity(name, kw, cfg, reference, _mlm_batch, TRAIN)
                          for name, kw in TRAIN_LAYOUTS.items()}
    if torch.distributed.get_rank() == 0:
        Path(sys.argv[1]).write_text(json.dumps(errors))
    destroy_distributed()


if __name__ == "__main__":
    _main()
