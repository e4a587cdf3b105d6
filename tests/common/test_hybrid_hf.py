"""The hybrid kind against transformers' NemotronHForCausalLM and Mamba2ForCausalLM, on random
tiny models made here (fp32): Tessera's import of transformers' save gives the same logits and
loss, and exporting back gives transformers' model.safetensors byte for byte and its config."""

from __future__ import annotations

import json

import pytest
import torch

from tessera.common.errors import ArtifactError
from tessera.common.hf.directory import load_hf_weights, read_hf_config
from tessera.common.models import registry

VOCAB = 96
NEMOTRON_H = dict(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  intermediate_size=48, ssm_state_size=8, mamba_num_heads=4, mamba_head_dim=16, n_groups=2,
                  chunk_size=8, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                  moe_shared_expert_intermediate_size=24, n_group=2, topk_group=1, routed_scaling_factor=2.0,
                  layers_block_type=["linear_attention", "mlp", "full_attention", "moe", "linear_attention"])
MAMBA2 = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, state_size=8, num_heads=4, head_dim=16,
              n_groups=2, expand=2, chunk_size=8)


def hf_model(family: str, **over):
    """A random transformers model, every tensor informative: norms, biases, D, dt_bias and the
    routing bias drawn at random (transformers initialises them to constants, which would hide a
    dropped or swapped one), and a scaled head so that logits differ by more than the tolerance."""
    import transformers

    torch.manual_seed(0)
    if family == "nemotron_h":
        model = transformers.NemotronHForCausalLM(transformers.NemotronHConfig(**{**NEMOTRON_H, **over}))
    else:
        model = transformers.Mamba2ForCausalLM(transformers.Mamba2Config(**{**MAMBA2, **over}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "norm_f.weight", ".D", "dt_bias", ".bias")):
                p.normal_(1.0 if "norm" in name else 0.0, 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)
        model.get_output_embeddings().weight.mul_(20.0)
    return model.eval()


CASES = {
    "nemotron-h-M-*EM-grouped-routing": ("nemotron_h", {}),
    "mamba2": ("mamba2", {}),
    "mamba2-tied-projection-biases-no-conv-bias": ("mamba2", dict(tie_word_embeddings=True, use_bias=True,
                                                                  use_conv_bias=False, residual_in_fp32=False)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_logits_and_loss_equal_transformers_and_the_round_trip_gives_back_its_bytes_and_config(tmp_path, name):
    import transformers
    from safetensors.torch import save_file

    from tessera.trainer.objectives.loss import cross_entropy_loss

    family, over = CASES[name]
    hf = hf_model(family, **over)
    hf.save_pretrained(tmp_path / "hf")
    cfg, raw = read_hf_config(tmp_path / "hf")
    assert cfg.kind == "hybrid" and cfg.arch == family
    model = registry.kind_of(cfg).build(cfg, seed=None)
    model.load_state_dict(load_hf_weights(tmp_path / "hf", cfg), strict=True)
    model.eval()

    tokens = torch.randint(0, VOCAB, (2, 21), generator=torch.Generator().manual_seed(0))  # 3 chunks of 8, padded
    with torch.no_grad():
        theirs = hf(tokens, labels=tokens)
        ours = model(tokens)
        scale = theirs.logits.abs().max().item()  # relative to the logits' scale, as the causal LM's tests
        assert (ours - theirs.logits).abs().max().item() < 1e-5 * scale and theirs.logits.std() > 1.0
        loss = cross_entropy_loss(model(tokens[:, :-1]), tokens[:, 1:])
        torch.testing.assert_close(loss, theirs.loss, atol=1e-5, rtol=1e-5)

    adapter = registry.hf_adapter(cfg)
    state = model.state_dict()
    exported = {r.target: r.apply([state[s] for s in r.sources]).contiguous() for r in adapter.export_rules(cfg)}
    (tmp_path / "out").mkdir()
    save_file(exported, tmp_path / "out" / "model.safetensors", metadata={"format": "pt"})
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == (tmp_path / "hf" / "model.safetensors").read_bytes()
    config = adapter.hf_config(cfg, torch.float32, raw["bos_token_id"], raw["eos_token_id"], raw["pad_token_id"])
    (tmp_path / "out" / "config.json").write_text(json.dumps(config))
    again = transformers.AutoConfig.from_pretrained(tmp_path / "out").to_dict()
    expected = hf.config.to_dict()
    assert {k: v for k, v in again.items() if k != "_name_or_path"} == \
        {k: v for k, v in expected.items() if k != "_name_or_path"}


def _config(tmp_path, family: str, **changes):
    hf_model(family).config.save_pretrained(tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    data.update(changes)
    return data


@pytest.mark.parametrize("family, changes, message", [
    ("nemotron_h", dict(mlp_hidden_act="silu"), "field 'mlp_hidden_act' = 'silu' is not supported (Tessera builds "
                                                "Nemotron-H's squared-ReLU MLPs)"),
    ("nemotron_h", dict(moe_latent_size=8), "field 'moe_latent_size' = 8 is not supported"),
    ("nemotron_h", dict(num_nextn_predict_layers=1), "field 'num_nextn_predict_layers' = 1 is not supported"),
    ("nemotron_h", dict(tie_word_embeddings=True), "field 'tie_word_embeddings' = True is not supported"),
    ("nemotron_h", dict(layers_block_type=["linear_attention", "cross_attention"]), "field 'layers_block_type' must list"),
    ("nemotron_h", dict(n_groups=3), "model mamba: Value error, num_groups (3) must divide num_heads (4)"),
    ("mamba2", dict(hidden_act="gelu"), "field 'hidden_act' = 'gelu' is not supported"),
    ("mamba2", dict(expand=3), "field 'expand' x hidden_size (3 x 32) must equal num_heads x head_dim (64)"),
    ("mamba2", dict(time_step_limit=[0.5, 0.1]), "field 'time_step_limit' must be [low, high]"),
])
def test_an_hf_config_with_options_tessera_does_not_build_is_refused_naming_the_field(tmp_path, family, changes,
                                                                                        message):
    data = _config(tmp_path, family, **changes)
    with pytest.raises(ArtifactError) as exc:
        registry.model_config_from_hf(data, "hf/config.json")
    assert str(exc.value).startswith("hf/config.json: ") and message in str(exc.value), str(exc.value)
    assert "\n" not in str(exc.value)


def test_legacy_nemotron_h_spellings_are_read_as_transformers_reads_them(tmp_path):
    data = _config(tmp_path, "nemotron_h")
    new = registry.model_config_from_hf(data, "c")
    del data["layers_block_type"]
    data["hybrid_override_pattern"] = "M-*EM"  # Megatron's string, as older files wrote it
    assert registry.model_config_from_hf(data, "c") == new
    data["layers_block_type"] = ["mamba", "mlp", "attention", "moe", "mamba"]  # names before transformers 5
    assert registry.model_config_from_hf(data, "c") == new
    mamba2 = _config(tmp_path, "mamba2", time_step_limit=[0.0, float("inf")])  # a bare Infinity, as older files
    assert registry.model_config_from_hf(mamba2, "c").mamba.dt_limit_max is None
