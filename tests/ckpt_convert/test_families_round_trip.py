"""Every model family through the converter: transformers' directory -> import -> reshard (TP2,
PP2, and EP2 for the mixtures of experts) -> reshard back -> export gives back transformers'
weights byte for byte, and a config.json transformers reads as the same model."""

from __future__ import annotations

import json

import pytest
import torch
from hf_families import CASES, build

from tessera.ckpt_convert.cli import run
from tessera.common.checkpoint import read_sidecar, resolve_checkpoint

MOE_FAMILIES = ("mixtral", "qwen3_moe")


@pytest.mark.parametrize("name", list(CASES))
def test_import_reshard_and_back_export_is_bit_identical(tmp_path, tokenizer_dir, name):
    from safetensors.torch import load_file

    family, over = CASES[name]
    hf = build(family, **over)
    hf.save_pretrained(tmp_path / "hf")
    for f in tokenizer_dir.iterdir():
        (tmp_path / "hf" / f.name).write_bytes(f.read_bytes())
    assert run(["import", "--format", "hf", "--input", str(tmp_path / "hf"), "--output", str(tmp_path / "c11"),
                "--quiet"]) == 0
    moe = family in MOE_FAMILIES
    assert run(["reshard", "--checkpoint", str(tmp_path / "c11"), "--output", str(tmp_path / "c22"),
                "--tensor-parallel", "2", "--pipeline-parallel", "2", *(["--expert-parallel", "2"] if moe else []),
                "--quiet"]) == 0
    if moe:  # the experts really were split over two expert ranks on the way
        import torch.distributed.checkpoint as dcp

        c22 = resolve_checkpoint(tmp_path / "c22")
        assert read_sidecar(c22).layout.expert == 2
        meta = dcp.FileSystemReader(str(c22)).read_metadata().state_dict_metadata
        experts = next(k for k in meta if k.endswith("mlp.experts.gate_proj"))
        assert sorted((c.offsets[0], c.sizes[0]) for c in meta[experts].chunks) == [(0, 2), (2, 2)]
    assert run(["reshard", "--checkpoint", str(tmp_path / "c22"), "--output", str(tmp_path / "back"),
                "--tensor-parallel", "1", "--pipeline-parallel", "1", *(["--expert-parallel", "1"] if moe else []),
                "--quiet"]) == 0
    assert run(["export", "--format", "hf", "--checkpoint", str(tmp_path / "back"), "--output",
                str(tmp_path / "out"), "--quiet"]) == 0
    theirs, ours = load_file(tmp_path / "hf" / "model.safetensors"), load_file(tmp_path / "out" / "model.safetensors")
    assert theirs.keys() == ours.keys()
    for k in theirs:
        assert theirs[k].dtype == ours[k].dtype and torch.equal(theirs[k], ours[k]), k
    import transformers

    config = transformers.AutoConfig.from_pretrained(tmp_path / "out")
    again = transformers.AutoModelForCausalLM.from_config(config).eval()
    again.load_state_dict(hf.state_dict())
    tokens = torch.randint(0, 512, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(again(tokens).logits, hf(tokens).logits)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == family
