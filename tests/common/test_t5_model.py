"""T5 encoder-decoder parity with transformers' T5ForConditionalGeneration (random tiny models)."""

import pytest
import torch
import transformers

from tessera.common.models.encoder_decoder.config import T5Config
from tessera.common.models.encoder_decoder.hf_names import hf_name
from tessera.common.models.encoder_decoder.model import T5Model


@pytest.mark.parametrize("variant", ["t5", "v1_1"])
def test_t5_logits_and_loss_equal_transformers_for_both_variants(variant):
    v11 = variant == "v1_1"
    kw = dict(vocab_size=128, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=3, num_heads=4,
              relative_attention_num_buckets=8, relative_attention_max_distance=16,
              feed_forward="gated-gelu" if v11 else "relu", tie_word_embeddings=not v11)
    torch.manual_seed(0)
    ref = transformers.T5ForConditionalGeneration(transformers.T5Config(
        **{k: v for k, v in kw.items() if k != "feed_forward"}, feed_forward_proj=kw["feed_forward"],
        dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)).eval()
    ours = T5Model(T5Config(**kw)).eval()
    theirs = ref.state_dict()
    ours.load_state_dict({n: theirs[hf_name(n, v11)] for n in ours.state_dict()})
    ids = torch.randint(1, 128, (2, 11))
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0
    labels = torch.randint(1, 128, (2, 7))
    labels[0, 5:] = -100
    with torch.no_grad():
        want = ref(input_ids=ids, attention_mask=mask, labels=labels)
        logits, loss = ours(ids, attention_mask=mask, labels=labels)
    torch.testing.assert_close(logits, want.logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(loss, want.loss, atol=1e-5, rtol=1e-5)


def test_t5_config_refuses_a_pad_id_outside_the_vocabulary_and_bucket_settings_that_divide_by_zero():
    shape = dict(vocab_size=8, d_model=8, d_kv=4, d_ff=8, num_layers=1, num_decoder_layers=1, num_heads=2)
    with pytest.raises(ValueError, match="pad_token_id"):
        T5Config(**shape, pad_token_id=9)
    with pytest.raises(ValueError, match="relative_attention_max_distance"):
        T5Config(**shape, relative_attention_num_buckets=32, relative_attention_max_distance=16)
    with pytest.raises(ValueError, match="relative_attention_num_buckets"):
        T5Config(**shape, relative_attention_num_buckets=2)


def test_t5_tensor_shapes_are_the_transformers_shapes_under_their_names():
    from tessera.common.models.encoder_decoder.model import model_tensor_shapes

    kw = dict(vocab_size=64, d_model=16, d_kv=4, d_ff=24, num_layers=1, num_decoder_layers=2, num_heads=2,
              feed_forward="gated-gelu", tie_word_embeddings=False)
    ref = transformers.T5ForConditionalGeneration(transformers.T5Config(
        **{k: v for k, v in kw.items() if k != "feed_forward"}, feed_forward_proj="gated-gelu",
        decoder_start_token_id=0, pad_token_id=0))
    theirs = {n: tuple(t.shape) for n, t in ref.state_dict().items()}
    ours = {hf_name(n, True): s for n, s in model_tensor_shapes(T5Config(**kw)).items()}
    assert {n: theirs[n] for n in ours} == ours
    assert set(theirs) - set(ours) <= {"encoder.embed_tokens.weight", "decoder.embed_tokens.weight"}


@pytest.mark.parametrize("variant", ["t5", "v1_1"])
def test_t5_config_counts_the_parameters_of_its_model_exactly(variant):
    cfg = T5Config(vocab_size=64, d_model=16, d_kv=4, d_ff=24, num_layers=1, num_decoder_layers=2, num_heads=3,
                   feed_forward="gated-gelu" if variant == "v1_1" else "relu", tie_word_embeddings=variant == "t5")
    with torch.device("meta"):
        model = T5Model(cfg)
    assert cfg.num_params() == sum(p.numel() for p in model.parameters())
