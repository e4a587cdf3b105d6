"""DeepSeek-V3's multi-token prediction against a reference written here from the math, on
transformers' own decoder layer and norms: an MTP depth's logits (enorm/hnorm, eh_proj over
[embedding of token t+1 ; main hidden at t], one MoE decoder layer, shared_head norm, the shared
head), its loss over the positions that have a token t+2, and the gradient the training forward
injects (main loss + scaling factor x MTP loss)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from deepseek_hf import build_hf, save_with_mtp

from tessera.common.hf.directory import load_hf_weights, read_hf_config
from tessera.common.models.causal_lm.model import build_model


def reference_mtp_logits(hf, mtp: dict[str, torch.Tensor], block, tokens: torch.Tensor) -> torch.Tensor:
    """Depth 1 at position t from the main model's final hidden state at t and token t+1."""
    cfg, layer = hf.config, hf.config.num_hidden_layers
    p = f"model.layers.{layer}."

    def rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps) * w

    hidden = hf.model(tokens).last_hidden_state  # final-normed, as the MTP module reads it
    nxt = torch.cat((tokens[:, 1:], tokens[:, :1]), dim=1)  # token t+1 at t (the last one unused)
    x = torch.cat((rms(hf.model.embed_tokens(nxt), mtp[p + "enorm.weight"]), rms(hidden, mtp[p + "hnorm.weight"])), -1)
    x = x @ mtp[p + "eh_proj.weight"].T
    positions = torch.arange(tokens.shape[1]).unsqueeze(0)
    x = block(x, attention_mask=None, position_ids=positions, position_embeddings=hf.model.rotary_emb(x, positions))
    x = x[0] if isinstance(x, tuple) else x
    return rms(x, mtp[p + "shared_head.norm.weight"]) @ mtp[p + "shared_head.head.weight"].T


def test_an_mtp_depth_gives_the_logits_and_loss_of_the_reference_and_trains_through_the_main_output(tmp_path):
    hf = build_hf()
    mtp, block = save_with_mtp(hf, tmp_path / "hf")
    cfg, _ = read_hf_config(tmp_path / "hf")
    assert cfg.mtp is not None and cfg.mtp.depth == 1
    ours = build_model(cfg, seed=None).eval()
    ours.load_state_dict(load_hf_weights(tmp_path / "hf", cfg), strict=True)
    assert cfg.num_params() == sum(p.numel() for p in ours.parameters())
    seq = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(0))
    inputs, labels = seq[:, :-1], seq[:, 1:]
    with torch.no_grad():
        theirs = reference_mtp_logits(hf, mtp, block.eval(), inputs)
        hidden = ours(inputs, return_hidden=True)
        logits = ours.logits(ours.mtp_hidden(0, hidden, inputs.roll(-1, dims=1)))
    valid = slice(0, inputs.shape[1] - 1)  # the last position has no token t+1 in the window
    scale = theirs[:, valid].abs().max().item()
    assert (logits[:, valid] - theirs[:, valid]).abs().max().item() < 1e-5 * scale

    # Training forward: output unchanged, the depth's loss recorded, its gradient injected.
    ours.train()
    factor = cfg.mtp.loss_scaling_factor
    ours.mtp.prepare(1)
    out = ours(inputs, mtp_labels=labels)
    F.cross_entropy(out.flatten(0, 1), labels.flatten()).backward()
    injected = {n: p.grad.clone() for n, p in ours.named_parameters() if p.grad is not None}
    ref_loss = F.cross_entropy(theirs[:, valid].flatten(0, 1), labels[:, 1:].flatten()).item()
    metrics = ours.mtp.metrics()
    assert abs(metrics["mtp_loss"] - ref_loss) < 1e-5 * ref_loss, (metrics, ref_loss)
    ours.zero_grad()
    hidden = ours(inputs, return_hidden=True)
    mtp_logits = ours.logits(ours.mtp_hidden(0, hidden, inputs.roll(-1, dims=1)))[:, valid]
    total = (F.cross_entropy(ours.logits(hidden).flatten(0, 1), labels.flatten())
             + factor * F.cross_entropy(mtp_logits.flatten(0, 1), labels[:, 1:].flatten()))
    total.backward()
    assert injected.keys() == {n for n, p in ours.named_parameters() if p.grad is not None}
    assert any(n.startswith("mtp.layers.0.") for n in injected)
    for name, grad in injected.items():
        assert torch.allclose(grad, ours.get_parameter(name).grad, rtol=1e-4, atol=1e-7), name
