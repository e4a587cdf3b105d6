"""torch.compile under torchrun: every transformer block's forward compiled (per block, as
torchtitan does), TP=2 with sequence parallel on gloo/CPU, fp32, against the uncompiled single
process: per-step losses 1e-5, pre-clip gradient norms 1e-4, final weights as in test_parity."""

from __future__ import annotations

import json

import parallel_harness as H
import pytest
import torch
from test_parity import assert_close_seq, assert_weights, torchrun

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

STEPS = 4
NORM_RTOL = 1e-4


def test_compiled_blocks_under_tp2_train_like_one_process(tmp_path):
    torch.set_num_threads(1)
    norms: list[float] = []
    ref_losses, ref_model, _ = H.reference_run(H.model_config(), STEPS, grad_norms=norms)
    job = dict(name="tp2_compiled", layout=dict(tensor=2), steps=STEPS, save=str(tmp_path / "tp2_compiled"),
               training=dict(micro_batch_size=1, compile=True), parallel=dict(sequence_parallel=True),
               out=str(tmp_path / "tp2_compiled.json"), compiled=True)
    torchrun(2, {"jobs": [job]}, tmp_path, timeout=500)
    r = json.loads((tmp_path / "tp2_compiled.json").read_text())
    assert r["compiled_blocks"] > 0  # the blocks really ran through torch.compile
    assert_close_seq(r["losses"], ref_losses, "tp2 compiled")
    for i, (got, want) in enumerate(zip(r["grad_norms"], norms)):
        assert abs(got - want) <= NORM_RTOL * want, f"tp2 compiled: step {i}: grad norm {got} vs {want}"
    assert r["divergence"] == [0.0, 0.0]
    assert_weights(tmp_path / "tp2_compiled", ref_model, "tp2 compiled")
