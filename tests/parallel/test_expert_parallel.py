"""Expert parallel dispatch (all-to-all over gloo) against the one-process MoE layer."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

WORKER = Path(__file__).parent / "expert_worker.py"


def test_experts_sharded_over_two_ranks_compute_what_one_process_computes(tmp_path):
    out = tmp_path / "ep"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(WORKER), str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    ranks = [torch.load(f"{out}.rank{r}.pt", weights_only=True) for r in range(2)]
    for r in ranks:
        assert (r["y"] - r["ref_y"]).norm() / r["ref_y"].norm() < 1e-6
        assert (r["x_grad"] - r["ref_x_grad"]).norm() / r["ref_x_grad"].norm() < 1e-6  # the combine's backward
    # Expert weights: each rank's slice holds the gradient of every token routed to its experts,
    # from both ranks: the reference's rows of that slice.
    for name in ("experts.gate_proj", "experts.up_proj", "experts.down_proj"):
        got = torch.cat([r["grads"][name] for r in ranks])
        want = ranks[0]["ref_grads"][name]
        assert got.shape == want.shape and (got - want).norm() / want.norm() < 1e-6, name
    # Router and shared experts are replicated: the sum over ranks of their gradients is the reference's.
    for name in ("router.weight", "shared.gate_proj.weight", "shared.down_proj.weight"):
        got = ranks[0]["grads"][name] + ranks[1]["grads"][name]
        want = ranks[0]["ref_grads"][name]
        assert (got - want).norm() / want.norm() < 1e-6, name
    assert all(r["load"].sum() == 6 * 2 for r in ranks)  # each rank's own tokens x top_k
