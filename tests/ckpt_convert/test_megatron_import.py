"""`tessera-ckpt import --format megatron`: a torch_dist checkpoint written by megatron-core's own
code (on CPU, tests/ckpt_convert/megatron_save.py) imports into the model that gives Megatron's
logits; legacy pickles and non-torch_dist directories are one line, exit 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from tessera.ckpt_convert.cli import main, run
from tessera.common.checkpoint import load_model_tensors, read_sidecar, resolve_checkpoint
from tessera.common.models.causal_lm.model import build_model

HERE = Path(__file__).parent
CASES = {  # grouped-query attention with Megatron's vocabulary padding; tied embeddings
    "gqa-untied-padded": dict(num_layers=2, hidden_size=64, num_heads=8, num_kv_heads=2, ffn_hidden_size=96,
                              vocab_size=200, rows=256, tied=False, max_seq_len=64, port=29561),
    "mha-tied": dict(num_layers=2, hidden_size=32, num_heads=4, num_kv_heads=4, ffn_hidden_size=64,
                     vocab_size=128, rows=128, tied=True, max_seq_len=64, port=29562),
}


def megatron(mode: str, cases: list[tuple[dict, Path]]) -> None:
    """megatron_save.py on each (spec, directory), in one process."""
    argv = []
    for spec, directory in cases:
        (directory.parent / "spec.json").write_text(json.dumps(spec))
        argv += [str(directory.parent / "spec.json"), str(directory)]
    proc = subprocess.run([sys.executable, str(HERE / "megatron_save.py"), mode, *argv], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_megatron_core_checkpoints_import_with_megatrons_logits_and_export_back_with_them(tmp_path):
    pytest.importorskip("megatron.core")
    cases = [(spec, tmp_path / name / "mcore" / "iter_0000001") for name, spec in CASES.items()]
    for _, ckpt in cases:
        ckpt.mkdir(parents=True)
    megatron("save", cases)
    backs = []
    for name, spec in CASES.items():
        root = tmp_path / name
        model_cfg = dict(arch="llama", vocab_size=spec["vocab_size"], hidden_size=spec["hidden_size"],
                         num_layers=spec["num_layers"], num_heads=spec["num_heads"],
                         num_kv_heads=spec["num_kv_heads"], ffn_hidden_size=spec["ffn_hidden_size"],
                         max_seq_len=spec["max_seq_len"], tie_embeddings=spec["tied"], norm_eps=1e-5)
        (root / "model.yaml").write_text(yaml.safe_dump(model_cfg))
        assert run(["import", "--format", "megatron", "--input", str(root / "mcore" / "iter_0000001"), "--output",
                    str(root / "ours"), "--model-config", str(root / "model.yaml"), "--quiet"]) == 0
        directory = resolve_checkpoint(root / "ours")
        cfg = read_sidecar(directory).model
        assert cfg.vocab_size == spec["vocab_size"] and cfg.vocab_rows == spec["rows"]
        model = build_model(cfg, seed=None)
        model.load_state_dict(load_model_tensors(directory))
        ref = torch.load(root / "mcore" / "reference.pt")
        with torch.no_grad():
            ours = model.eval()(ref["tokens"])
        want = ref["logits"][..., :spec["vocab_size"]]
        assert torch.isneginf(ours[..., spec["vocab_size"]:]).all()
        assert (ours[..., :spec["vocab_size"]] - want).abs().max().item() < 1e-4 * want.abs().max().item(), name
        # And back: our export loads in megatron-core (dist_checkpointing.load) and gives the same logits.
        back = root / "back" / "iter_0000002"
        assert run(["export", "--format", "megatron", "--checkpoint", str(root / "ours"), "--output", str(back),
                    "--quiet"]) == 0
        backs.append((spec, back))
    megatron("load", backs)
    for name, spec in CASES.items():
        ref, loaded = torch.load(tmp_path / name / "mcore" / "reference.pt"), torch.load(tmp_path / name / "back" /
                                                                                          "loaded.pt")
        want = ref["logits"][..., :spec["vocab_size"]]
        assert torch.equal(loaded["tokens"], ref["tokens"])
        got = loaded["logits"][..., :spec["vocab_size"]]
        assert (got - want).abs().max().item() < 1e-5 * want.abs().max().item(), name


def test_legacy_pickle_checkpoint_is_refused_with_the_way_to_convert_it(tmp_path, capsys):
    legacy = tmp_path / "iter_0000010" / "mp_rank_00"
    legacy.mkdir(parents=True)
    (legacy / "model_optim_rng.pt").write_bytes(b"\x80\x04not read")
    (tmp_path / "model.yaml").write_text(yaml.safe_dump(dict(vocab_size=8, hidden_size=8, num_layers=1, num_heads=2,
                                                             ffn_hidden_size=8)))
    with pytest.raises(SystemExit) as exc:
        main(["import", "--format", "megatron", "--input", str(tmp_path / "iter_0000010"), "--output",
              str(tmp_path / "out"), "--model-config", str(tmp_path / "model.yaml")])
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and len(err.splitlines()) == 1
    assert "pickles" in err and "torch_dist" in err and not (tmp_path / "out").exists()
