"""LLaVA through `tessera-ckpt` and Hugging Face: random tiny LlavaForConditionalGeneration models
(CLIP + Llama, SigLIP + Qwen2) made here; import -> export gives transformers' model.safetensors
and config.json byte for byte, the image processor's preprocessor_config.json carried along."""

from __future__ import annotations

import json

import pytest
import torch

from tessera.ckpt_convert.cli import main, run
from tessera.common.checkpoint import read_sidecar, resolve_checkpoint

VOCAB = 320  # the tokenizer fixture's 300 tokens fit


def hf_llava(tower: str):
    import transformers

    torch.manual_seed(0)
    common = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=32,
                  patch_size=8)
    text = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2)
    if tower == "clip":
        vision, lm = transformers.CLIPVisionConfig(**common), transformers.LlamaConfig(**text)
    else:
        vision, lm = transformers.SiglipVisionConfig(**common), transformers.Qwen2Config(**text)
    cfg = transformers.LlavaConfig(vision_config=vision, text_config=lm, image_token_id=299)
    model = transformers.LlavaForConditionalGeneration(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.normal_(0.0, 0.2)
    return model.eval()


@pytest.mark.parametrize("tower", ["clip", "siglip"])
def test_llava_import_then_export_gives_transformers_bytes_config_and_processor_file(tmp_path, tokenizer_dir, tower):
    import transformers

    hf = hf_llava(tower)
    hf.save_pretrained(tmp_path / "hf")
    for f in tokenizer_dir.iterdir():
        (tmp_path / "hf" / f.name).write_bytes(f.read_bytes())
    processor = (transformers.CLIPImageProcessor if tower == "clip" else transformers.SiglipImageProcessor)(
        size={"shortest_edge": 32} if tower == "clip" else {"height": 32, "width": 32},
        crop_size={"height": 32, "width": 32})
    processor.save_pretrained(tmp_path / "hf")
    assert run(["import", "--format", "hf", "--input", str(tmp_path / "hf"), "--output", str(tmp_path / "ckpt"),
                "--quiet"]) == 0
    assert read_sidecar(resolve_checkpoint(tmp_path / "ckpt")).model.kind == "vision_language"
    assert run(["export", "--format", "hf", "--checkpoint", str(tmp_path / "ckpt"), "--output",
                str(tmp_path / "out"), "--quiet"]) == 0
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == (tmp_path / "hf" / "model.safetensors").read_bytes()
    # config.json: the same model to Tessera and to transformers (the text config is the causal LM
    # adapter's, with its tokenizer's bos/eos and both dtype keys, so not transformers' bytes).
    from tessera.common.models.registry import model_config_from_hf

    ours, theirs = (json.loads((tmp_path / d / "config.json").read_text()) for d in ("out", "hf"))
    assert model_config_from_hf(ours, "out") == model_config_from_hf(theirs, "hf")
    again = transformers.LlavaForConditionalGeneration.from_pretrained(tmp_path / "out").eval()
    ids = torch.tensor([[5] + [299] * (15 if tower == "siglip" else 16) + [7, 9]])
    pixels = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(again(input_ids=ids, pixel_values=pixels).logits,
                                   hf(input_ids=ids, pixel_values=pixels).logits, atol=0, rtol=0)
    assert json.loads((tmp_path / "out" / "preprocessor_config.json").read_text()) == \
        json.loads((tmp_path / "hf" / "preprocessor_config.json").read_text())


def test_importing_a_llava_option_tessera_lacks_exits_2_naming_the_field_and_writes_nothing(tmp_path, capsys):
    hf_llava("clip").save_pretrained(tmp_path / "hf")
    data = json.loads((tmp_path / "hf" / "config.json").read_text())
    data["vision_feature_layer"] = [-2, -1]  # several layers concatenated: not built
    (tmp_path / "hf" / "config.json").write_text(json.dumps(data))
    capsys.readouterr()  # transformers' save progress bar
    with pytest.raises(SystemExit) as exc:
        main(["import", "--format", "hf", "--input", str(tmp_path / "hf"), "--output", str(tmp_path / "ckpt"), "--quiet"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "vision_feature_layer" in err[0] and not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("tower", ["clip", "siglip"])
def test_llava_import_reshard_to_tp2_and_pp2_and_back_then_export_gives_transformers_bytes(tmp_path, tokenizer_dir, tower):
    import torch.distributed.checkpoint as dcp

    hf_llava(tower).save_pretrained(tmp_path / "hf")
    for f in tokenizer_dir.iterdir():
        (tmp_path / "hf" / f.name).write_bytes(f.read_bytes())
    assert run(["import", "--format", "hf", "--input", str(tmp_path / "hf"), "--output", str(tmp_path / "c1"),
                "--quiet"]) == 0
    assert run(["reshard", "--checkpoint", str(tmp_path / "c1"), "--output", str(tmp_path / "c2"),
                "--tensor-parallel", "2", "--pipeline-parallel", "2", "--quiet"]) == 0
    meta = dcp.FileSystemReader(str(resolve_checkpoint(tmp_path / "c2"))).read_metadata().state_dict_metadata

    def cuts(key: str) -> list[tuple[int, ...]]:
        return sorted(tuple(c.offsets) for c in meta["model." + key].chunks)

    # As the plan cuts: the tower's blocks like the LM's (q/k/v and up by rows, o and down by
    # columns), the projector column then row, the vocabulary by rows, norms and embeddings whole.
    assert cuts("vision.layers.1.attn.q_proj.weight") == [(0, 0), (16, 0)]
    assert cuts("vision.layers.0.attn.o_proj.weight") == [(0, 0), (0, 16)]
    assert cuts("vision.layers.0.mlp.down_proj.weight") == [(0, 0), (0, 32)]
    assert cuts("projector.linear_1.weight") == [(0, 0), (24, 0)] and cuts("projector.linear_1.bias") == [(0,), (24,)]
    assert cuts("projector.linear_2.weight") == [(0, 0), (0, 24)] and cuts("projector.linear_2.bias") == [(0,)]
    assert cuts("language_model.embed_tokens.weight") == [(0, 0), (VOCAB // 2, 0)]
    assert cuts("language_model.layers.1.mlp.gate_proj.weight") == [(0, 0), (48, 0)]
    assert cuts("vision.pos_embed.weight") == [(0, 0)] and cuts("vision.layers.0.attn_norm.weight") == [(0,)]

    # Pipeline: the tower, projector and embedding with layer 0 on stage 0, layer 1, the final norm
    # and the head on stage 1 (the trainer's placement: partition.pipeline_rank).
    from tessera.ckpt_convert.partition import pipeline_rank

    sidecar = read_sidecar(resolve_checkpoint(tmp_path / "c2"))
    stage = {name: pipeline_rank(name, sidecar.model, sidecar.layout) for name in (
        "vision.layers.1.mlp.up_proj.weight", "projector.linear_2.bias", "language_model.embed_tokens.weight",
        "language_model.layers.0.attn.q_proj.weight", "language_model.layers.1.attn.q_proj.weight",
        "language_model.final_norm.weight", "language_model.lm_head.weight")}
    assert list(stage.values()) == [0, 0, 0, 0, 1, 1, 1], stage
    assert run(["reshard", "--checkpoint", str(tmp_path / "c2"), "--output", str(tmp_path / "back"),
                "--tensor-parallel", "1", "--pipeline-parallel", "1", "--quiet"]) == 0
    assert run(["export", "--format", "hf", "--checkpoint", str(tmp_path / "back"), "--output",
                str(tmp_path / "out"), "--quiet"]) == 0
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == (tmp_path / "hf" / "model.safetensors").read_bytes()


def test_a_reshard_whose_tensor_size_does_not_divide_the_towers_heads_exits_2_naming_the_field(tmp_path, capsys):
    hf_llava("clip").save_pretrained(tmp_path / "hf")
    assert run(["import", "--format", "hf", "--input", str(tmp_path / "hf"), "--output", str(tmp_path / "c1"),
                "--quiet"]) == 0
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        main(["reshard", "--checkpoint", str(tmp_path / "c1"), "--output", str(tmp_path / "tp8"),
              "--tensor-parallel", "8", "--pipeline-parallel", "1", "--quiet"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "model.vision.num_heads (4)" in err and "--tensor-parallel 8" in err, err
    assert not (tmp_path / "tp8").exists()
