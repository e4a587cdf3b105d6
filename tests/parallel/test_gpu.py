"""The same parity on CUDA/NCCL (skipped without a GPU).

One GPU: the runtime in a one-process NCCL group; two or more: TP=2 with sequence parallel and
PP=2. Compared with the single-process CPU reference, so the tolerance allows for the different
kernels (no TF32: fp32 matmuls on the GPU are true fp32 by default).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import parallel_harness as H
import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

WORKER = Path(__file__).parent / "worker.py"


def test_gpu_parity(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    n = min(2, torch.cuda.device_count())
    layouts = [dict(data=1)] if n == 1 else [dict(tensor=2), dict(pipeline=2)]
    jobs = [dict(name=f"gpu{i}", layout=lay, training=dict(micro_batch_size=2),
                 steps=5, out=str(tmp_path / f"{i}.json"))
            for i, lay in enumerate(layouts)]
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"jobs": jobs}))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
                           str(WORKER), str(spec)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-6000:]
    want, _, _ = H.reference_run(H.model_config(), 5)
    for i in range(len(layouts)):
        got = json.loads((tmp_path / f"{i}.json").read_text())["losses"]
        assert all(abs(g - w) <= 1e-4 * w for g, w in zip(got, want)), (layouts[i], got, want)
