"""Random tiny transformers DeepSeek-V3 models, built at test time (shared by the model, converter
and trainer tests)."""

from __future__ import annotations

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
