"""benchmarks/train_throughput.py on a tiny model: both frameworks train to the same loss, and the
--breakdown profile finds the shared kernels in both.

The benchmark's figures only mean something if the two steps do the same work: same weights, data,
loss, clipping and AdamW. Trained side by side for a few steps, Tessera's compiled step (forward +
logsumexp loss as one graph) and transformers' standard recipe must end at the same loss.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "train_throughput.py"
TINY = ["--hidden", "64", "--heads", "2", "--kv-heads", "2", "--ffn", "128", "--vocab", "512", "--layers", "2",
        "--seq", "32", "--batch", "2", "--warmup", "1", "--threads", "1"]


def run_benchmark(tmp_path: Path, *extra: str) -> dict:
    out = tmp_path / "figures.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), *TINY, *extra, "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    figures = json.loads(out.read_text())
    figures["stdout"] = proc.stdout
    return figures


def check_breakdown(result: dict) -> None:
    shared = result["breakdown"]["shared_ms"]
    assert shared["gemm"] > 0 and shared["attention"] > 0 and shared["clip+optimizer"] > 0, shared
    assert sum(shared.values()) < result["breakdown"]["wall_ms"]


def test_compiled_step_trains_like_transformers_and_breakdown_finds_shared_kernels(tmp_path):
    figures = run_benchmark(tmp_path, "--steps", "3", "--breakdown", "1")
    results = figures["results"]
    # 1 + 3 + 1 steps from identical weights and data (warm-up, timed, profiled: "loss after" is the last timed).
    assert results["tessera"]["final_loss"] == pytest.approx(results["transformers"]["final_loss"], rel=1e-5)
    for result in results.values():
        check_breakdown(result)
    assert "ceiling" in figures["stdout"]


def test_separate_processes_pool_rounds_and_breakdowns(tmp_path):
    figures = run_benchmark(tmp_path, "--no-compile", "--steps", "2", "--separate-processes", "--rounds", "2",
                            "--breakdown", "1")
    results = figures["results"]
    assert len(results["tessera"]["step_times_s"]) == len(results["transformers"]["step_times_s"]) == 4
    assert results["tessera"]["final_loss"] == pytest.approx(results["transformers"]["final_loss"], rel=1e-5)
    for result in results.values():
        check_breakdown(result)
    assert "2 rounds (ABBA order)" in figures["stdout"] and "no ceiling across processes" in figures["stdout"]


def test_packed_documents_train_like_transformers(tmp_path):
    """--packed-documents: Tessera's data.reset_* / eod_mask_loss step and transformers' packed-sequence
    recipe (restarting position_ids, labels -100 on end-of-document inputs) end at the same loss."""
    figures = run_benchmark(tmp_path, "--steps", "2", "--packed-documents", "8")
    results = figures["results"]
    assert results["tessera"]["final_loss"] == pytest.approx(results["transformers"]["final_loss"], rel=1e-5)
    assert "packed documents of ~8 tokens" in figures["stdout"]
