"""The encoder kind: BERT as transformers' BertModel / BertForMaskedLM / BertForPreTraining. Random
tiny transformers models made at test time are read through the kind's HF adapter into Tessera's
encoder, which must give the same hidden states, pooled states and logits (fp32, 1e-5) on padded
batches with token types, and the same pretraining loss; exported tensors and config.json are
what transformers itself saves."""

from __future__ import annotations

import json

import pytest
import torch

from tessera.common.hf.directory import load_hf_weights, read_hf_config
from tessera.common.models import registry
from tessera.common.models.encoder.config import EncoderConfig

VOCAB = 120


def hf_bert(cls: str, **over):
    """A transformers BERT with random (not init-pattern) biases and norms, so a dropped or
    swapped one shows in the outputs."""
    import transformers

    torch.manual_seed(0)
    config_class = transformers.MegatronBertConfig if cls.startswith("Megatron") else transformers.BertConfig
    config = config_class(**{**dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                               num_attention_heads=4, intermediate_size=64,
                                               max_position_embeddings=40, type_vocab_size=2), **over})
    model = getattr(transformers, cls)(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.normal_(1.0 if ("LayerNorm.weight" in name or "ln.weight" in name) else 0.0, 0.2)
    return model.eval()


def batch(gen_seed: int = 1):
    gen = torch.Generator().manual_seed(gen_seed)
    tokens = torch.randint(1, VOCAB, (3, 17), generator=gen)
    types = torch.zeros_like(tokens)
    types[:, 9:] = 1
    mask = torch.ones_like(tokens)
    mask[1, 12:] = 0  # padded rows of different lengths
    mask[2, 5:] = 0
    return tokens, types, mask


def ours_from(tmp_path, hf):
    hf.save_pretrained(tmp_path)
    cfg, _ = read_hf_config(tmp_path)
    model = registry.kind_of(cfg).build(cfg, seed=None)
    model.load_state_dict(load_hf_weights(tmp_path, cfg), strict=True)
    return cfg, model.eval()


@pytest.mark.parametrize("cls", ["BertModel", "BertForMaskedLM", "BertForPreTraining", "MegatronBertModel", "MegatronBertForMaskedLM",
                                 "MegatronBertForPreTraining"])
def test_each_bert_class_gives_transformers_outputs_on_a_padded_batch_with_token_types(tmp_path, cls):
    hf = hf_bert(cls)
    cfg, model = ours_from(tmp_path, hf)
    assert cfg.norm_placement == ("pre" if cls.startswith("Megatron") else "post")
    cls = cls.removeprefix("Megatron")
    assert cfg.kind == "encoder" and (cfg.pooler, cfg.mlm_head, cfg.binary_head) == {
        "BertModel": (True, False, False), "BertForMaskedLM": (False, True, False),
        "BertForPreTraining": (True, True, True)}[cls]
    tokens, types, mask = batch()
    with torch.no_grad():
        ours = model(tokens, types, mask)
        theirs = hf(input_ids=tokens, token_type_ids=types, attention_mask=mask, output_hidden_states=True)
        hidden = theirs.last_hidden_state if cls == "BertModel" else theirs.hidden_states[-1]
        torch.testing.assert_close(ours.hidden, hidden, atol=1e-5, rtol=1e-5)
        if cls == "BertModel":
            torch.testing.assert_close(ours.pooled, theirs.pooler_output, atol=1e-5, rtol=1e-5)
            assert ours.mlm_logits is None and ours.binary_logits is None
        else:
            logits = theirs.logits if cls == "BertForMaskedLM" else theirs.prediction_logits
            torch.testing.assert_close(ours.mlm_logits, logits, atol=1e-5, rtol=1e-5)
        if cls == "BertForPreTraining":
            torch.testing.assert_close(ours.binary_logits, theirs.seq_relationship_logits, atol=1e-5, rtol=1e-5)
        # No mask and no token types: transformers' defaults (all real tokens, type 0).
        torch.testing.assert_close(model(tokens).hidden, hf(input_ids=tokens, output_hidden_states=True)
                                   .hidden_states[-1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cls", ["BertForPreTraining", "MegatronBertForPreTraining"])
def test_mlm_plus_binary_loss_equals_bert_for_pretraining_loss_on_a_masked_batch(tmp_path, cls):
    from tessera.trainer.objectives.loss import cross_entropy_loss

    hf = hf_bert(cls, hidden_act="gelu_pytorch_tanh", tie_word_embeddings=False)
    cfg, model = ours_from(tmp_path, hf)
    assert cfg.activation == "gelu" and not cfg.tie_embeddings
    tokens, types, mask = batch(2)
    gen = torch.Generator().manual_seed(3)
    chosen = (torch.rand(tokens.shape, generator=gen) < 0.15) & mask.bool()
    chosen[0, 3] = True
    labels = torch.where(chosen, tokens, -100)
    inputs = torch.where(chosen, 103 % VOCAB, tokens)  # the [MASK] id at the chosen places
    order = torch.tensor([0, 1, 1])
    with torch.no_grad():
        theirs = hf(input_ids=inputs, token_type_ids=types, attention_mask=mask, labels=labels,
                    next_sentence_label=order)
        ours = model(inputs, types, mask)
        loss = cross_entropy_loss(ours.mlm_logits, labels) + cross_entropy_loss(ours.binary_logits[:, None], order[:, None])
    torch.testing.assert_close(loss, theirs.loss, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cls", ["BertModel", "BertForMaskedLM", "BertForPreTraining", "MegatronBertModel", "MegatronBertForMaskedLM",
                                 "MegatronBertForPreTraining"])
def test_adapter_export_is_byte_identical_to_save_pretrained(tmp_path, cls):
    from safetensors.torch import save_file

    hf = hf_bert(cls)
    cfg, model = ours_from(tmp_path / "hf", hf)
    adapter = registry.hf_adapter(cfg)
    state = model.state_dict()
    exported = {r.target: r.apply([state[s] for s in r.sources]).contiguous() for r in adapter.export_rules(cfg)}
    (tmp_path / "out").mkdir()
    save_file(exported, tmp_path / "out" / "model.safetensors", metadata={"format": "pt"})
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == (tmp_path / "hf" / "model.safetensors").read_bytes()
    import transformers

    written = adapter.hf_config(cfg, torch.float32, None, None, 0)
    text = json.dumps({**written, "transformers_version": transformers.__version__}, indent=2, sort_keys=True) + "\n"
    assert text == (tmp_path / "hf" / "config.json").read_text()


def test_config_bounds_heads_and_accounting():
    cfg = EncoderConfig(vocab_size=VOCAB, hidden_size=32, num_layers=3, num_heads=4, ffn_hidden_size=64,
                        max_seq_len=40, tie_embeddings=False).padded_for(2)
    assert cfg.vocab_rows == 256
    model = registry.kind_of(cfg).build(cfg)
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params()
    assert registry.kind_of(cfg).tensor_shapes(cfg) == {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert model.embed_tokens.weight[VOCAB:].abs().sum() == 0  # padding rows zero, logits -inf
    out = model.eval()(torch.randint(0, VOCAB, (2, 7)))
    assert torch.isinf(out.mlm_logits[..., VOCAB:]).all() and torch.isfinite(out.mlm_logits[..., :VOCAB]).all()
    assert registry.kind_of(cfg).flops_per_token(cfg, 128) > 6 * (cfg.num_params() - cfg.vocab_rows * 32 * 2)
    with pytest.raises(ValueError, match="binary_head needs pooler"):
        EncoderConfig(vocab_size=8, hidden_size=8, num_layers=1, num_heads=2, ffn_hidden_size=8, pooler=False)
    with pytest.raises(ValueError, match="less than or equal"):
        EncoderConfig(vocab_size=8, hidden_size=8, num_layers=10**6, num_heads=2, ffn_hidden_size=8)
    with pytest.raises(ValueError, match="position table"):
        model(torch.zeros(1, 41, dtype=torch.long))
    assert registry.model_config({"kind": "encoder", "preset": "bert-base"}).num_params() == 110_106_428


def test_pre_layernorm_encoder_gives_megatron_bert_for_pretraining_outputs_and_loss():
    """norm_placement=pre is transformers' MegatronBert (norm before attention and MLP, a final
    norm, no embedding norm): same hidden states, MLM and binary logits (weights copied by name)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.MegatronBertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                             num_attention_heads=4, intermediate_size=64,
                                             max_position_embeddings=40, type_vocab_size=2)
    hf = transformers.MegatronBertForPreTraining(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.ndim == 1:
                p.normal_(1.0 if ("ln.weight" in name or "LayerNorm.weight" in name) else 0.0, 0.2)
    cfg = EncoderConfig(vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4, ffn_hidden_size=64,
                        max_seq_len=40, norm_placement="pre")
    ours = registry.kind_of(cfg).build(cfg, seed=None).eval()
    sd = hf.state_dict()
    names = {"embed_tokens": "bert.embeddings.word_embeddings", "pos_embed": "bert.embeddings.position_embeddings",
             "token_type_embed": "bert.embeddings.token_type_embeddings", "final_norm": "bert.encoder.ln",
             "pooler.dense": "bert.pooler.dense", "mlm_head.dense": "cls.predictions.transform.dense",
             "mlm_head.norm": "cls.predictions.transform.LayerNorm", "binary_head": "cls.seq_relationship"}
    for i in range(2):
        h = f"bert.encoder.layer.{i}."
        names.update({f"layers.{i}.attn_norm": h + "attention.ln", f"layers.{i}.attn.q_proj": h + "attention.self.query",
                      f"layers.{i}.attn.k_proj": h + "attention.self.key", f"layers.{i}.attn.v_proj": h + "attention.self.value",
                      f"layers.{i}.attn.o_proj": h + "attention.output.dense", f"layers.{i}.mlp_norm": h + "ln",
                      f"layers.{i}.mlp.up_proj": h + "intermediate.dense", f"layers.{i}.mlp.down_proj": h + "output.dense"})
    state = {k: sd[names[k.rsplit(".", 1)[0]] + "." + k.rsplit(".", 1)[1]] for k in ours.state_dict()
             if k != "mlm_head.decoder.bias"}
    state["mlm_head.decoder.bias"] = sd["cls.predictions.bias"]
    assert "embed_norm.weight" not in ours.state_dict() and "final_norm.weight" in ours.state_dict()
    ours.load_state_dict(state, strict=True)
    assert cfg.num_params() == sum(p.numel() for p in ours.parameters())
    tokens, types, mask = batch()
    with torch.no_grad():
        want = hf(input_ids=tokens, token_type_ids=types, attention_mask=mask)
        got = ours(tokens, types, mask)
    torch.testing.assert_close(got.mlm_logits, want.prediction_logits, rtol=0, atol=1e-5)
    torch.testing.assert_close(got.binary_logits, want.seq_relationship_logits, rtol=0, atol=1e-5)
    post = EncoderConfig(vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4, ffn_hidden_size=64)
    assert "embed_norm.weight" in registry.kind_of(post).build(post).state_dict()  # the default is unchanged
