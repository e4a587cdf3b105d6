"""The vision-language kind against transformers' LlavaForConditionalGeneration: random tiny models
(CLIP + Llama, SigLIP + Qwen2) made here, imported through the kind's Hugging Face adapter, give
the same logits (fp32, 1e-5) for the same pixels and text, with 1 and 2 images per sample."""

from __future__ import annotations

import json

import pytest
import torch

from tessera.common.errors import ArtifactError
from tessera.common.models.registry import kind_for_hf, model_config_from_hf, model_kind

transformers = pytest.importorskip("transformers")

IMAGE_TOKEN = 100


def _hf_llava(tower: str, feature_layer: int = -2, strategy: str = "default"):
    from transformers import (
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        Qwen2Config,
        SiglipVisionConfig,
    )

    torch.manual_seed(0)
    common = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=32, patch_size=8)
    if tower == "clip":
        vision = CLIPVisionConfig(**common)
        text = LlamaConfig(vocab_size=128, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2)
    else:
        vision = SiglipVisionConfig(**common)
        text = Qwen2Config(vocab_size=128, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2)
    cfg = LlavaConfig(vision_config=vision, text_config=text, image_token_id=IMAGE_TOKEN,
                      vision_feature_layer=feature_layer, vision_feature_select_strategy=strategy)
    model = LlavaForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # transformers' init leaves LayerNorms at one / zero: make them matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def _ours(hf_model):

    data = json.loads(hf_model.config.to_json_string(use_diff=False))
    data["architectures"] = ["LlavaForConditionalGeneration"]
    kind = kind_for_hf(data, "config.json")
    cfg = model_config_from_hf(data, "config.json")
    hf_sd = hf_model.state_dict()
    rules, _ = kind.hf().import_rules(cfg, set(hf_sd))
    model = kind.build(cfg, seed=None)
    state = {r.target: (r.combine or (lambda ts: ts[0]))([hf_sd[s] for s in r.sources]) for r in rules}
    missing = set(model.state_dict()) - set(state) - {k for k, _ in model.named_buffers()}
    assert not missing, missing
    model.load_state_dict(state, strict=False)
    return kind, cfg, model.eval()


@pytest.mark.parametrize("tower,layer,strategy", [("clip", -2, "default"), ("siglip", -1, "full")])
def test_logits_equal_transformers_llava_for_one_and_two_images_per_sample(tower, layer, strategy):
    hf_model = _hf_llava(tower, layer, strategy)
    kind, cfg, ours = _ours(hf_model)
    assert kind.name == "vision_language" and cfg.vision.arch == tower
    n = cfg.image_seq_len
    g = torch.Generator().manual_seed(1)
    for images in (1, 2):
        text = torch.randint(0, 90, (2, 6), generator=g)
        ids = torch.cat([text[:, :2]] + [torch.full((2, n), IMAGE_TOKEN), text[:, 2:4]] * images + [text[:, 4:]], dim=1)
        pixels = torch.randn(2 * images, 3, 32, 32, generator=g)
        with torch.no_grad():
            want = hf_model(input_ids=ids, pixel_values=pixels).logits
            got = ours(ids, pixels)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_kind_records_shapes_flops_and_tensor_names_of_the_built_model():
    hf_model = _hf_llava("siglip")
    kind, cfg, ours = _ours(hf_model)
    assert kind is model_kind("vision_language")
    assert list(kind.tensor_shapes(cfg).items()) == [(k, tuple(v.shape)) for k, v in ours.state_dict().items()]
    assert cfg.num_params() == sum(p.numel() for p in ours.parameters())
    assert kind.flops_per_token(cfg, 64) > cfg.text.flops_per_token(64)
    exported = {r.target for r in kind.hf().export_rules(cfg)}
    assert len(exported) == len(hf_model.state_dict())  # the saved names: tests/ckpt_convert/test_vlm_hf_round_trip.py


def test_an_unsupported_llava_option_is_refused_naming_the_field():
    data = json.loads(_hf_llava("clip").config.to_json_string(use_diff=False))
    data["vision_feature_layer"] = [-2, -1]
    with pytest.raises(ArtifactError, match="vision_feature_layer"):
        model_config_from_hf(data, "config.json")
    data["vision_feature_layer"], data["projector_hidden_act"] = -2, "relu"
    with pytest.raises(ArtifactError, match="projector_hidden_act"):
        model_config_from_hf(data, "config.json")


@pytest.mark.parametrize("tower", ["clip", "siglip"])
def test_the_tower_alone_equals_transformers_vision_model_with_post_norm_and_pooling(tower):
    hf_model = _hf_llava(tower)
    _, _, ours = _ours(hf_model)
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = hf_model.model.vision_tower(pixel_values=pixels)
        hidden, pooled = ours.vision(pixels)
    torch.testing.assert_close(hidden, want.last_hidden_state, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pooled, want.pooler_output, atol=1e-5, rtol=1e-5)


def test_image_tokens_that_do_not_match_the_images_features_are_refused():
    _, cfg, ours = _ours(_hf_llava("clip"))
    ids = torch.tensor([[1] + [IMAGE_TOKEN] * (cfg.image_seq_len - 1) + [2]])
    with pytest.raises(ValueError, match="image tokens in the text for 1 image"):
        ours(ids, torch.zeros(1, 3, 32, 32))
    with pytest.raises(ValueError, match="no images"):
        ours(ids)


def test_a_language_model_with_multi_token_prediction_inside_a_vision_language_model_is_refused_not_ignored():
    """The VLM trains the answer tokens' next-token loss alone: an MTP section would build modules
    that never train."""
    from pydantic import ValidationError

    from tessera.common.models.registry import model_config

    text = dict(arch="deepseek_v3", vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, ffn_hidden_size=64,
                max_seq_len=32, mtp={"depth": 1})
    vision = dict(hidden_size=32, num_layers=2, num_heads=4, ffn_hidden_size=64, image_size=16, patch_size=8)
    with pytest.raises(ValidationError, match=r"text\.mtp: multi-token prediction is not built"):
        model_config(dict(kind="vision_language", image_token_id=60, vision=vision, text=text))
