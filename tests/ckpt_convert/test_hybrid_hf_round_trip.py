"""Hybrid models through `tessera-ckpt` and Hugging Face: random tiny NemotronHForCausalLM (a pattern
with M, *, - and E) and Mamba2ForCausalLM made here with transformers; import -> reshard (TP2, PP2,
EP2 where MoE) -> reshard back -> export gives transformers' model.safetensors byte for byte and a
config.json transformers reads as the same config. Options the model does not build, and the
conversions that have no hybrid mapping (TensorRT-LLM), are one line and exit 2."""

from __future__ import annotations

import json

import pytest
import torch

from tessera.ckpt_convert.cli import main, run
from tessera.common.checkpoint import read_sidecar, resolve_checkpoint

VOCAB = 320  # the tokenizer fixture's 300 tokens fit; divisible by 2 for TP2
NEMOTRON_H = dict(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  intermediate_size=48, ssm_state_size=8, mamba_num_heads=4, mamba_head_dim=16, n_groups=2,
                  chunk_size=8, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                  moe_shared_expert_intermediate_size=24, n_group=2, topk_group=1, routed_scaling_factor=2.0,
                  layers_block_type=["linear_attention", "mlp", "full_attention", "moe", "linear_attention"])
MAMBA2 = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, state_size=8, num_heads=4, head_dim=16,
              n_groups=2, expand=2, chunk_size=8)
TOKEN_IDS = dict(bos_token_id=0, eos_token_id=1, pad_token_id=2)  # the tokenizer fixture's specials


def hf_model(family: str, **over):
    """A random transformers model whose every tensor is informative (norms, D, dt_bias, biases and
    the routing bias drawn at random, not transformers' constants, so a swap cannot hide)."""
    import transformers

    torch.manual_seed(0)
    if family == "nemotron_h":
        model = transformers.NemotronHForCausalLM(transformers.NemotronHConfig(**{**NEMOTRON_H, **TOKEN_IDS, **over}))
    else:
        model = transformers.Mamba2ForCausalLM(transformers.Mamba2Config(**{**MAMBA2, **TOKEN_IDS, **over}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "norm_f.weight", ".D", "dt_bias", ".bias")):
                p.normal_(1.0 if "norm" in name else 0.0, 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)
    return model.eval()


def save_hf(tmp_path, tokenizer_dir, family: str, **over):
    hf = hf_model(family, **over)
    hf.save_pretrained(tmp_path / "hf")
    for f in tokenizer_dir.iterdir():
        (tmp_path / "hf" / f.name).write_bytes(f.read_bytes())
    return hf


def one_line_exit_2(capsys, argv: list[str]) -> str:
    capsys.readouterr()  # drop what came before (transformers' save progress bar)
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and len(err.splitlines()) == 1, err
    return err


CASES = {
    "nemotron-h-M-*EM": ("nemotron_h", {}, ["--expert-parallel", "2"]),
    "mamba2": ("mamba2", {}, []),
    "mamba2-tied-projection-biases-no-conv-bias": ("mamba2", dict(tie_word_embeddings=True, use_bias=True,
                                                                  use_conv_bias=False), []),
}


@pytest.mark.parametrize("name", list(CASES))
def test_import_reshard_to_tp2_pp2_and_back_then_export_gives_transformers_bytes_and_config(
        tmp_path, tokenizer_dir, name):
    import torch.distributed.checkpoint as dcp
    import transformers

    family, over, ep = CASES[name]
    hf = save_hf(tmp_path, tokenizer_dir, family, **over)
    assert run(["import", "--format", "hf", "--input", str(tmp_path / "hf"), "--output", str(tmp_path / "c11"),
                "--quiet"]) == 0
    assert read_sidecar(resolve_checkpoint(tmp_path / "c11")).model.kind == "hybrid"
    assert run(["reshard", "--checkpoint", str(tmp_path / "c11"), "--output", str(tmp_path / "c22"),
                "--tensor-parallel", "2", "--pipeline-parallel", "2", *ep, "--quiet"]) == 0
    # The split really happened, as the parallel plan cuts: whole heads / groups of each in_proj part
    # and conv channel block per tensor rank, out_proj by columns, experts over the expert ranks.
    c22 = resolve_checkpoint(tmp_path / "c22")
    meta = dcp.FileSystemReader(str(c22)).read_metadata().state_dict_metadata

    def cuts(key: str) -> list[tuple[int, ...]]:
        return sorted(tuple(c.offsets) for c in meta["model." + key].chunks)

    assert cuts("layers.0.mixer.in_proj.b.weight") == [(0, 0), (8, 0)]  # 2 groups x 8 state: one group each
    assert cuts("layers.0.mixer.conv.x.weight") == [(0, 0, 0), (32, 0, 0)]
    assert cuts("layers.0.mixer.A_log") == [(0,), (2,)] and cuts("layers.0.mixer.norm.weight") == [(0,), (32,)]
    assert cuts("layers.0.mixer.out_proj.weight") == [(0, 0), (0, 32)]
    assert cuts("layers.0.norm.weight") == [(0,)]
    if ep:
        assert cuts("layers.3.mixer.experts.up_proj") == [(0, 0, 0), (2, 0, 0)]
        assert cuts("layers.1.mixer.up_proj.weight") == [(0, 0), (24, 0)]
        assert cuts("layers.2.mixer.o_proj.weight") == [(0, 0), (0, 16)]
    assert run(["reshard", "--checkpoint", str(tmp_path / "c22"), "--output", str(tmp_path / "back"),
                "--tensor-parallel", "1", "--pipeline-parallel", "1", "--quiet"]) == 0
    assert run(["export", "--format", "hf", "--checkpoint", str(tmp_path / "back"), "--output",
                str(tmp_path / "out"), "--quiet"]) == 0
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == (tmp_path / "hf" / "model.safetensors").read_bytes()
    again = transformers.AutoConfig.from_pretrained(tmp_path / "out").to_dict()
    assert {k: v for k, v in again.items() if k != "_name_or_path"} == \
        {k: v for k, v in hf.config.to_dict().items() if k != "_name_or_path"}


def test_hybrid_import_refuses_vocabulary_padding_and_trtllm_export_in_one_line(tmp_path, tokenizer_dir, capsys):
    save_hf(tmp_path, tokenizer_dir, "mamba2")
    err = one_line_exit_2(capsys, ["import", "--format", "hf", "--input", str(tmp_path / "hf"), "--output",
                                   str(tmp_path / "c"), "--vocab-size-divisible-by", "128", "--quiet"])
    assert "--vocab-size-divisible-by 128" in err and "hybrid" in err and not (tmp_path / "c").exists()
    assert run(["import", "--format", "hf", "--input", str(tmp_path / "hf"), "--output", str(tmp_path / "c"),
                "--quiet"]) == 0
    err = one_line_exit_2(capsys, ["export", "--format", "trtllm", "--checkpoint", str(tmp_path / "c"), "--output",
                                   str(tmp_path / "trt"), "--quiet"])
    assert "'hybrid'" in err and "export --format trtllm" in err and not (tmp_path / "trt").exists()


@pytest.mark.parametrize("family, changes, field", [
    ("mamba2", dict(hidden_act="gelu"), "hidden_act"),
    ("nemotron_h", dict(mamba_hidden_act="relu"), "mamba_hidden_act"),
    ("nemotron_h", dict(mlp_hidden_act="silu"), "mlp_hidden_act"),
    ("nemotron_h", dict(num_nextn_predict_layers=1), "num_nextn_predict_layers"),
    ("nemotron_h", dict(sliding_window=16), "sliding_window"),
])
def test_an_hf_directory_with_options_not_built_is_refused_naming_the_field(tmp_path, tokenizer_dir, capsys,
                                                                           family, changes, field):
    save_hf(tmp_path, tokenizer_dir, family)
    data = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**data, **changes}))
    err = one_line_exit_2(capsys, ["import", "--format", "hf", "--input", str(tmp_path / "hf"), "--output",
                                   str(tmp_path / "c"), "--quiet"])
    assert "config.json" in err and f"'{field}'" in err and not (tmp_path / "c").exists(), err


def test_legacy_nemotron_h_mamba_field_names_are_read_as_transformers_reads_them(tmp_path, tokenizer_dir):
    """Older Nemotron-H config.json files spell the mixer's settings mamba_conv_bias, mamba_d_conv,
    mamba_n_groups, mamba_chunk_size...; transformers renames them as it loads. A conv bias turned off
    only under the old name must not come back as on."""
    save_hf(tmp_path, tokenizer_dir, "nemotron_h", use_conv_bias=False)
    data = json.loads((tmp_path / "hf" / "config.json").read_text())
    legacy = {"use_conv_bias": "mamba_conv_bias", "conv_kernel": "mamba_d_conv", "n_groups": "mamba_n_groups",
              "chunk_size": "mamba_chunk_size", "time_step_min": "mamba_dt_min"}
    for new, old in legacy.items():
        data[old] = data.pop(new)
    (tmp_path / "hf" / "config.json").write_text(json.dumps(data))
    assert run(["import", "--format", "hf", "--input", str(tmp_path / "hf"), "--output", str(tmp_path / "c"),
                "--quiet"]) == 0
    m = read_sidecar(resolve_checkpoint(tmp_path / "c")).model.mamba
    assert (m.conv_bias, m.conv_kernel, m.num_groups, m.chunk_size) == (False, 4, 2, 8)
