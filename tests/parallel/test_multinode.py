"""Two torchrun "nodes" on this machine, one c10d rendezvous on 127.0.0.1, one parallel job.

Each launch is a node with one process (--nnodes 2); together they run a pipeline-parallel job
configured through the trainer's flags (tessera.trainer.parallel.launch) and must reproduce the
single-process losses.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import parallel_harness as H
import pytest
from torch.distributed import TCPStore

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

WORKER = Path(__file__).parent / "worker.py"
STEPS = 3


def test_two_nodes_c10d_rendezvous(tmp_path):
    out = tmp_path / "out.json"
    spec = {"jobs": [{"name": "pp2_2nodes", "argv": ["--pipeline-parallel", "2"], "training": {"micro_batch_size": 2},
                      "steps": STEPS, "out": str(out)}]}
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(json.dumps(spec))
    # The test hosts the rendezvous store on a port it bound (0: the OS's choice) and both nodes join
    # it as clients (is_host=false): a port picked, closed and handed to a node could be taken first.
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    nodes = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
             "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{store.port}", "--rdzv-id=tessera-test",
             "--rdzv-conf=is_host=false", f"--node-rank={node}", str(WORKER), str(spec_path)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        for node in range(2)
    ]
    logs = []
    for p in nodes:
        try:
            o, e = p.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            for q in nodes:
                q.kill()
            raise
        logs.append(o[-2000:] + e[-4000:])
    assert all(p.returncode == 0 for p in nodes), "\n----\n".join(logs)
    got = json.loads(out.read_text())["losses"]
    want, _, _ = H.reference_run(H.model_config(), STEPS)
    for g, w in zip(got, want):
        assert abs(g - w) <= 1e-5 * abs(w)
