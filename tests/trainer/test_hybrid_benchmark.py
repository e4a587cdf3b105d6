"""benchmarks/hybrid_training.py on a tiny shape: Tessera's train step and transformers'
NemotronHForCausalLM, started from the same weights on the same batches, reach the same loss (so
the tokens/s it records compare the same computation), and it reports the ratio."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "hybrid_training.py"


def test_the_hybrid_benchmark_trains_both_frameworks_to_the_same_loss(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("hybrid_training", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "out.json"
    assert bench.main(["--hidden", "64", "--vocab", "256", "--seq", "32", "--chunk", "16", "--batch", "2",
                       "--steps", "2", "--warmup", "1", "--threads", "1", "--json", str(out)]) == 0
    runs = json.loads(out.read_text())["runs"]
    ours, theirs = runs["tessera"]["final_loss"], runs["transformers"]["final_loss"]
    assert abs(ours - theirs) < 1e-4 * abs(theirs), (ours, theirs)
    assert "Tessera / transformers NemotronHForCausalLM:" in capsys.readouterr().out
