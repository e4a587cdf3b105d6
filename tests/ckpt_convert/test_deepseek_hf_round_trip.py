"""DeepSeek-V3 through the converter CLI: transformers' save -> import -> export gives back its
weights byte for byte (the interleaved RoPE rows permuted and restored, the balancing bias kept)
and a config.json transformers reads as the same model; a bad config.json is one line, exit 2."""

from __future__ import annotations

import json

import pytest
import torch
from deepseek_hf import build_hf, save_with_mtp

from tessera.ckpt_convert.cli import main, run


def save(hf, directory, tokenizer_dir):
    hf.save_pretrained(directory)
    for f in tokenizer_dir.iterdir():
        (directory / f.name).write_bytes(f.read_bytes())


@pytest.mark.parametrize("over", [{}, dict(q_lora_rank=None, n_group=1, topk_group=1)], ids=["q-lora", "no-q-lora"])
def test_deepseek_v3_import_export_is_byte_identical(tmp_path, tokenizer_dir, over):
    from safetensors.torch import load_file

    hf = build_hf(**over)
    save(hf, tmp_path / "hf", tokenizer_dir)
    assert run(["import", "--format", "hf", "--input", str(tmp_path / "hf"), "--output", str(tmp_path / "ckpt"),
                "--quiet"]) == 0
    assert run(["export", "--format", "hf", "--checkpoint", str(tmp_path / "ckpt"), "--output",
                str(tmp_path / "out"), "--quiet"]) == 0
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == (tmp_path / "hf" / "model.safetensors").read_bytes()
    theirs, ours = load_file(tmp_path / "hf" / "model.safetensors"), load_file(tmp_path / "out" / "model.safetensors")
    assert theirs.keys() == ours.keys()
    for k in theirs:
        assert theirs[k].dtype == ours[k].dtype and torch.equal(theirs[k], ours[k]), k
    import transformers

    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["model_type"] == "deepseek_v3" and written["num_nextn_predict_layers"] == 0
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    tokens = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(again(tokens).logits, hf(tokens).logits)


def test_deepseek_v3_with_its_mtp_layer_imports_and_exports_byte_identically(tmp_path, tokenizer_dir, capsys):
    """DeepSeek's MTP layer (model.layers.<num_hidden_layers>.*: a decoder layer, enorm/hnorm,
    eh_proj, shared_head.norm and copies of the embedding and head) lands in Tessera's checkpoint and
    comes back byte for byte, with num_nextn_predict_layers=1; the Megatron export writes it as
    Megatron's mtp.layers.0.* (names and parity with megatron-core: test_megatron_mla.py)."""
    mtp, _ = save_with_mtp(build_hf(), tmp_path / "hf")
    for f in tokenizer_dir.iterdir():
        (tmp_path / "hf" / f.name).write_bytes(f.read_bytes())
    assert run(["import", "--format", "hf", "--input", str(tmp_path / "hf"), "--output", str(tmp_path / "ckpt"),
                "--quiet"]) == 0
    from tessera.common.checkpoint import read_sidecar, resolve_checkpoint

    cfg = read_sidecar(resolve_checkpoint(tmp_path / "ckpt")).model
    assert cfg.mtp is not None and cfg.mtp.depth == 1
    assert run(["export", "--format", "hf", "--checkpoint", str(tmp_path / "ckpt"), "--output",
                str(tmp_path / "out"), "--quiet"]) == 0
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == (tmp_path / "hf" / "model.safetensors").read_bytes()
    assert json.loads((tmp_path / "out" / "config.json").read_text())["num_nextn_predict_layers"] == 1
    assert "model.layers.3.eh_proj.weight" in mtp and "model.layers.3.mlp.experts.7.down_proj.weight" in mtp
    assert run(["export", "--format", "megatron", "--checkpoint", str(tmp_path / "ckpt"), "--output",
                str(tmp_path / "mg"), "--quiet"]) == 0
    from tessera.common.safe_dcp import read_dcp_metadata

    names = read_dcp_metadata(tmp_path / "mg").state_dict_metadata
    assert "mtp.layers.0.eh_proj.weight" in names and "mtp.layers.0.final_layernorm.weight" in names


def test_deepseek_v3_import_reshard_tp2_ep2_pp2_and_back_export_is_byte_identical(tmp_path, tokenizer_dir):
    """The latent attention splits as the tensor-parallel plan cuts it (q_b / kv_b by heads, o by
    columns, the down projections and latent norms whole), the experts over expert ranks, an MTP
    depth like a layer of the last stage; back at one rank, export gives the same bytes."""
    import torch.distributed.checkpoint as dcp

    from tessera.common.checkpoint import resolve_checkpoint

    save_with_mtp(build_hf(), tmp_path / "hf")
    for f in tokenizer_dir.iterdir():
        (tmp_path / "hf" / f.name).write_bytes(f.read_bytes())
    assert run(["import", "--format", "hf", "--input", str(tmp_path / "hf"), "--output", str(tmp_path / "c1"),
                "--quiet"]) == 0
    assert run(["reshard", "--checkpoint", str(tmp_path / "c1"), "--output", str(tmp_path / "c8"),
                "--tensor-parallel", "2", "--expert-parallel", "2", "--pipeline-parallel", "2", "--quiet"]) == 0
    meta = dcp.FileSystemReader(str(resolve_checkpoint(tmp_path / "c8"))).read_metadata().state_dict_metadata

    def cuts(key: str) -> list[tuple[int, ...]]:
        return sorted(tuple(c.offsets) for c in meta["model." + key].chunks)

    heads = 4 * (16 + 12) // 2  # kv_b rows per rank: two heads of [k_nope | v]
    assert cuts("layers.1.attn.kv_b_proj.weight") == [(0, 0), (heads, 0)]
    assert cuts("layers.1.attn.q_b_proj.weight") == [(0, 0), (2 * 24, 0)]
    assert cuts("layers.1.attn.o_proj.weight") == [(0, 0), (0, 2 * 12)]
    assert cuts("layers.1.attn.kv_a_proj.weight") == [(0, 0)] and cuts("layers.1.attn.q_a_norm.weight") == [(0,)]
    assert cuts("layers.1.mlp.experts.gate_proj") == [(0, 0, 0), (4, 0, 0)]
    assert cuts("mtp.layers.0.attn.kv_b_proj.weight") == [(0, 0), (heads, 0)]
    assert cuts("mtp.layers.0.mlp.experts.down_proj") == [(0, 0, 0), (4, 0, 0)]
    assert cuts("mtp.layers.0.eh_proj.weight") == [(0, 0)]
    assert run(["reshard", "--checkpoint", str(tmp_path / "c8"), "--output", str(tmp_path / "back"),
                "--tensor-parallel", "1", "--expert-parallel", "1", "--pipeline-parallel", "1", "--quiet"]) == 0
    assert run(["export", "--format", "hf", "--checkpoint", str(tmp_path / "back"), "--output",
                str(tmp_path / "out"), "--quiet"]) == 0
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == (tmp_path / "hf" / "model.safetensors").read_bytes()


@pytest.mark.parametrize("field,value,message", [
    ("n_group", 3, "num_groups (3) must divide num_experts (8)"),
    ("topk_group", 5, "topk_groups (5) must not exceed num_groups (4)"),
    ("num_key_value_heads", 2, "num_key_value_heads"),
])
def test_bad_deepseek_config_is_one_line_exit_2(tmp_path, tokenizer_dir, capsys, field, value, message):
    save(build_hf(), tmp_path / "hf", tokenizer_dir)
    capsys.readouterr()  # the save's progress bar
    path = tmp_path / "hf" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), field: value}))
    with pytest.raises(SystemExit) as exc:
        main(["import", "--format", "hf", "--input", str(tmp_path / "hf"), "--output", str(tmp_path / "out")])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "out").exists()


def test_what_is_not_built_for_latent_attention_is_refused_in_one_line_before_any_work(tmp_path, tokenizer_dir, capsys):
    """The TensorRT-LLM export of an MLA model is not built (Megatron's is: test_megatron_mla.py;
    serving: tests/inference/test_deepseek_serving.py): it says so in one line, exit 2, nothing
    written. Context parallel is built (tests/parallel/test_deepseek_parallel.py): the layout passes."""
    from tessera.common.errors import run_cli

    save(build_hf(), tmp_path / "hf", tokenizer_dir)
    assert run(["import", "--format", "hf", "--input", str(tmp_path / "hf"), "--output", str(tmp_path / "ckpt"),
                "--quiet"]) == 0
    capsys.readouterr()
    for cli, argv, message in (
            (main, ["export", "--format", "trtllm"], "TensorRT-LLM"),):
        args = [*argv, "--checkpoint", str(tmp_path / "ckpt")]
        if cli is main:
            args += ["--output", str(tmp_path / "out")]
        with pytest.raises(SystemExit) as exc:
            run_cli(cli, args)
        err = capsys.readouterr().err.strip()
        assert exc.value.code == 2 and len(err.splitlines()) == 1 and message in err and "mla" in err, err
        assert not (tmp_path / "out").exists()
    from tessera.common.checkpoint import read_sidecar, resolve_checkpoint
    from tessera.common.layout import ParallelLayout, validate_layout

    cfg = read_sidecar(resolve_checkpoint(tmp_path / "ckpt")).model
    validate_layout(cfg, ParallelLayout(context=2))
