"""Random tiny transformers DeepSeek-V3 models, built at test time (shared by the model, converter
and trainer tests)."""

from __future__ import annotations

import json

import torch

BASE = dict(vocab_size=320, hidden_size=48, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
            kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=12, qk_nope_head_dim=16,
            n_group=4, topk_group=2, num_experts_per_tok=3, first_k_dense_replace=1, routed_scaling_factor=2.5,
            max_position_embeddings=128, bos_token_id=None, eos_token_id=None, pad_token_id=None)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 1.0}


def build_hf(**over):
    import transformers

    torch.manual_seed(0)
    config = transformers.DeepseekV3Config(**{**BASE, **over})
    hf = transformers.DeepseekV3ForCausalLM(config)
    with torch.no_grad():  # non-trivial norms and balancing bias; sharper attention
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.2)
            if name.endswith(("q_b_proj.weight", "q_proj.weight", "kv_a_proj_with_mqa.weight")):
                p.mul_(4.0)
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.05)
    return hf.eval()


def mtp_tensors(hf, directory) -> tuple[dict[str, torch.Tensor], torch.nn.Module]:
    """A random DeepSeek-style MTP depth 1 for `hf`, named and laid out as DeepSeek's checkpoints store
    it (layer num_hidden_layers, experts one by one), and its decoder layer as a transformers module:
    the last layer of a one-layer-deeper twin, saved by transformers under `directory`."""
    from safetensors.torch import load_file

    cfg = hf.config
    layer, d = cfg.num_hidden_layers, cfg.hidden_size
    twin = build_hf(**{**cfg.to_dict(), "num_hidden_layers": layer + 1, "rope_parameters": cfg.rope_parameters})
    twin.save_pretrained(directory)
    p = f"model.layers.{layer}."
    out = {k: v for k, v in load_file(directory / "model.safetensors").items() if k.startswith(p)}
    g = torch.Generator().manual_seed(1)
    for name in ("enorm", "hnorm", "shared_head.norm"):
        out[f"{p}{name}.weight"] = torch.empty(d).normal_(1.0, 0.2, generator=g)
    out[f"{p}eh_proj.weight"] = torch.empty(d, 2 * d).normal_(0.0, 0.1, generator=g)
    out[f"{p}embed_tokens.weight"] = hf.model.embed_tokens.weight.detach().clone()
    out[f"{p}shared_head.head.weight"] = hf.lm_head.weight.detach().clone()
    return out, twin.model.layers[layer]


def save_with_mtp(hf, directory) -> tuple[dict[str, torch.Tensor], torch.nn.Module]:
    """transformers' save plus DeepSeek's MTP layer in the same safetensors file, config.json saying
    num_nextn_predict_layers=1 (as DeepSeek-V3's own release)."""
    from safetensors.torch import load_file, save_file

    hf.save_pretrained(directory)
    mtp, block = mtp_tensors(hf, directory / "twin")
    tensors = {**load_file(directory / "model.safetensors"), **mtp}
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}, indent=2))
    return mtp, block
