"""FP8 (torchao Float8Linear, emulated on CPU) under the parallel runtime trains like one process.

One 2-process torchrun launch (gloo/CPU): ZeRO-1 data parallel, FSDP built on the meta device
(sharded init into the converted layers) and a 2-stage pipeline, each with
`ParallelConfig(fp8_recipe="tensorwise")`, against the one-process fp8 reference: the same
conversion under bf16 autocast, over the same micro-batches of 2 rows. The micro-batches matter:
tensorwise scales come from each activation's amax, so the reference must cast what a layout
casts; then the runs agree to float rounding, far closer than fp8 is to bf16 (a layout that lost
the conversion fails).
"""

from __future__ import annotations

import json

import parallel_harness as H
import pytest
import torch
import torch.nn.functional as F
from test_parity import torchrun

from tessera.common.model import build_model

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

STEPS = 5
MICRO = 2
# Measured: layouts within 1.2e-7 (data parallel, FSDP) and 8.1e-7 (pipeline) of the reference;
# fp8 vs bf16 2.8e-4 apart over these steps.
RTOL = 1e-5


def reference(fp8: bool) -> list[float]:
    """One process, gradients accumulated over micro-batches of MICRO rows (the runtime's loss:
    the mean of the micro-batch means), bf16 autocast, fp8 or not."""
    from tessera.trainer.fp8 import convert_to_float8

    torch.manual_seed(0)
    cfg = H.model_config()
    model = build_model(cfg, seed=H.MODEL_SEED)
    if fp8:
        convert_to_float8(model, "tensorwise")
    opt = H.reference_optimizer(model)
    losses = []
    for step in range(STEPS):
        tokens, targets = H.batch(step, cfg)
        opt.zero_grad(set_to_none=True)
        n = tokens.shape[0] // MICRO
        total = 0.0
        for i in range(n):
            rows = slice(i * MICRO, (i + 1) * MICRO)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model(tokens[rows])
            loss = F.cross_entropy(logits.float().reshape(-1, cfg.vocab_size), targets[rows].reshape(-1))
            (loss / n).backward()
            total += loss.item() / n
        torch.nn.utils.clip_grad_norm_(model.parameters(), H.OPTIM["max_grad_norm"])
        opt.step()
        losses.append(total)
    return losses


def test_fp8_data_parallel_fsdp_and_pipeline_match_one_process_fp8(tmp_path):
    pytest.importorskip("torchao")
    torch.set_num_threads(1)
    fp8 = dict(micro_batch=MICRO, fp8_recipe="tensorwise")
    jobs = {
        "fp8_dp2_zero": dict(layout=dict(data=2), parallel=fp8),
        "fp8_fsdp2_meta": dict(layout=dict(data=2, data_shard=2), parallel=fp8, meta=True),
        "fp8_pp2": dict(layout=dict(pipeline=2), parallel=fp8),
    }
    torchrun(2, {"jobs": [{**j, "name": n, "steps": STEPS, "out": str(tmp_path / f"{n}.json")}
                          for n, j in jobs.items()]}, tmp_path)
    want, bf16 = reference(fp8=True), reference(fp8=False)
    assert max(abs(a - b) / b for a, b in zip(want, bf16)) > 10 * RTOL, "fp8 must be distinguishable from bf16"
    for name in jobs:
        got = json.loads((tmp_path / f"{name}.json").read_text())["losses"]
        assert all(abs(g - w) <= RTOL * w for g, w in zip(got, want)), (name, got, want, bf16)
