"""`tessera-ckpt import --format hf-llava-parts`: a new LLaVA from a separate HF vision model
(CLIPVisionModel, SiglipVisionModel) and an HF causal LM, the projector fresh; the imported tower
and language model compute what the HF models compute, the processor file travels along."""

from __future__ import annotations

import json

import pytest
import torch

from tessera.ckpt_convert.cli import main, run
from tessera.common.checkpoint import load_model_tensors, read_sidecar, resolve_checkpoint


def _parts(tmp_path, tokenizer_dir, tower: str, image_token: bool = True):
    import transformers
    from tokenizers import Tokenizer

    torch.manual_seed(0)
    common = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=32,
                  patch_size=8)
    if tower == "clip":
        vision = transformers.CLIPVisionModel(transformers.CLIPVisionConfig(**common))
        processor = transformers.CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    else:
        vision = transformers.SiglipVisionModel(transformers.SiglipVisionConfig(**common))
        processor = transformers.SiglipImageProcessor(size={"height": 32, "width": 32})
    with torch.no_grad():  # transformers' init leaves LayerNorms at one / zero: make them matter
        for name, p in vision.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    vision.eval().save_pretrained(tmp_path / "vision")
    processor.save_pretrained(tmp_path / "vision")
    lm = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=320, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2)).eval()
    lm.save_pretrained(tmp_path / "lm")
    for f in tokenizer_dir.iterdir():
        (tmp_path / "lm" / f.name).write_bytes(f.read_bytes())
    if image_token:
        tok = Tokenizer.from_file(str(tmp_path / "lm" / "tokenizer.json"))
        tok.add_special_tokens(["<image>"])
        tok.save(str(tmp_path / "lm" / "tokenizer.json"))
    return vision, lm


@pytest.mark.parametrize("tower", ["clip", "siglip"])
def test_a_llava_imported_from_a_separate_vision_model_and_lm_computes_what_each_hf_model_computes(
        tmp_path, tokenizer_dir, tower):
    from tessera.common.models.vision_language.model import build_model

    vision, lm = _parts(tmp_path, tokenizer_dir, tower)
    # An instruct LM's own end of turn and sampling defaults: the LLaVA built on it keeps them.
    (tmp_path / "lm" / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [2, 7], "temperature": 0.6, "top_p": 0.9, "do_sample": True}))
    assert run(["import", "--format", "hf-llava-parts", "--vision", str(tmp_path / "vision"), "--language",
                str(tmp_path / "lm"), "--output", str(tmp_path / "ckpt"), "--quiet"]) == 0
    ckpt = resolve_checkpoint(tmp_path / "ckpt")
    cfg = read_sidecar(ckpt).model
    generation = read_sidecar(ckpt).generation
    assert (generation.eos_token_ids, generation.temperature, generation.top_p) == ([2, 7], 0.6, 0.9)
    assert cfg.kind == "vision_language" and cfg.vision.arch == tower and cfg.vision_feature_layer == -2
    model = build_model(cfg, seed=None)
    tensors = load_model_tensors(ckpt)
    model.load_state_dict(tensors, strict=False)
    assert set(model.state_dict()) - set(tensors) <= {k for k, _ in model.named_buffers()}
    model.eval()
    pixels = torch.randn(2, 3, 32, 32)
    ids = torch.tensor([[5, 17, 42, 9, 77, 3]])
    with torch.no_grad():
        theirs = vision(pixel_values=pixels, output_hidden_states=True)
        ours_last, _ = model.vision(pixels)
        if tower == "clip":  # CLIP's last state is the blocks' output; SigLIP post-LayerNorms it
            torch.testing.assert_close(ours_last, theirs.last_hidden_state, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(model.vision.hidden_states(pixels, 1), theirs.hidden_states[1], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(model(ids)[..., :320], lm(input_ids=ids).logits, atol=1e-5, rtol=1e-5)
    # the projector is fresh: the model's own init (Normal(0, init_std), zero biases)
    assert tensors["projector.linear_1.bias"].abs().max() == 0
    assert 0.005 < float(tensors["projector.linear_1.weight"].std()) < 0.05
    saved = resolve_checkpoint(tmp_path / "ckpt") / "tokenizer" / "preprocessor_config.json"
    assert json.loads(saved.read_text()) == json.loads((tmp_path / "vision" / "preprocessor_config.json").read_text())


def test_a_language_model_whose_tokenizer_has_no_image_token_is_refused_in_one_line(tmp_path, tokenizer_dir, capsys):
    _parts(tmp_path, tokenizer_dir, "clip", image_token=False)
    capsys.readouterr()  # transformers' save progress
    with pytest.raises(SystemExit) as exc:
        main(["import", "--format", "hf-llava-parts", "--vision", str(tmp_path / "vision"), "--language",
              str(tmp_path / "lm"), "--output", str(tmp_path / "ckpt"), "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1 and "'<image>'" in err[0] and "tokenizer.json" in err[0], err
    assert not (tmp_path / "ckpt").exists()
