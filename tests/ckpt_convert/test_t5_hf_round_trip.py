"""T5 through `tessera-ckpt` and Hugging Face: random tiny T5ForConditionalGeneration (T5: ReLU,
tied and scaled head; v1.1: gated GELU, its own head) made here with transformers; import ->
reshard TP2 -> reshard back -> export gives transformers' model.safetensors byte for byte and the
config.json and generation_config.json transformers writes."""

from __future__ import annotations

import pytest
import torch

from tessera.ckpt_convert.cli import run
from tessera.common.checkpoint import read_sidecar, resolve_checkpoint

VOCAB = 320  # the tokenizer fixture's 300 tokens fit; divisible by 2 for TP2


def hf_t5(variant: str):
    """A transformers T5 with random norms (and, for v1.1, a head of its own), so a dropped or
    swapped tensor changes the bytes."""
    import transformers

    v11 = variant == "v1_1"
    torch.manual_seed(0)
    config = transformers.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=3,
                                   num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=16,
                                   feed_forward_proj="gated-gelu" if v11 else "relu", tie_word_embeddings=not v11,
                                   decoder_start_token_id=0, pad_token_id=0)
    model = transformers.T5ForConditionalGeneration(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.normal_(1.0, 0.2)
    if v11:
        model.lm_head.weight = torch.nn.Parameter(torch.randn(VOCAB, 32))
    return model.eval()


@pytest.mark.parametrize("variant", ["t5", "v1_1"])
def test_t5_import_reshard_to_tp2_and_back_then_export_gives_transformers_bytes_and_config(
        tmp_path, tokenizer_dir, variant):
    import torch.distributed.checkpoint as dcp
    import transformers

    from tessera.common.models.encoder_decoder.hf.adapter import TRANSFORMERS_VERSION

    hf = hf_t5(variant)
    hf.save_pretrained(tmp_path / "hf")
    for f in tokenizer_dir.iterdir():
        (tmp_path / "hf" / f.name).write_bytes(f.read_bytes())
    spiece = bytes(range(256)) * 4  # stands for T5's SentencePiece model: carried as bytes, never parsed
    (tmp_path / "hf" / "spiece.model").write_bytes(spiece)
    assert run(["import", "--format", "hf", "--input", str(tmp_path / "hf"), "--output", str(tmp_path / "c1"),
                "--quiet"]) == 0
    cfg = read_sidecar(resolve_checkpoint(tmp_path / "c1")).model
    assert cfg.kind == "encoder_decoder" and cfg.tie_word_embeddings == (variant == "t5")
    assert cfg.scales_head == (variant == "t5")
    assert run(["info", str(tmp_path / "c1")]) == 0 and run(["verify", str(tmp_path / "c1"), "--quiet"]) == 0
    assert run(["reshard", "--checkpoint", str(tmp_path / "c1"), "--output", str(tmp_path / "c2"),
                "--tensor-parallel", "2", "--pipeline-parallel", "1", "--quiet"]) == 0
    meta = dcp.FileSystemReader(str(resolve_checkpoint(tmp_path / "c2"))).read_metadata().state_dict_metadata

    def cuts(key: str) -> list[tuple[int, ...]]:
        return sorted(tuple(c.offsets) for c in meta["model." + key].chunks)

    # As the plan cuts: q/k/v and the MLP's inputs by rows, o/down by columns, the relative-bias
    # tables by heads, the vocabulary by rows, norms whole.
    assert cuts("decoder.blocks.2.cross_attn.k_proj.weight") == [(0, 0), (16, 0)]
    assert cuts("encoder.blocks.1.self_attn.o_proj.weight") == [(0, 0), (0, 16)]
    assert cuts("decoder.blocks.0.mlp.down_proj.weight") == [(0, 0), (0, 24)]
    assert cuts("encoder.relative_attention_bias.weight") == [(0, 0), (0, 2)]
    assert cuts("shared.weight") == [(0, 0), (160, 0)] and cuts("encoder.final_norm.weight") == [(0,)]
    if variant == "v1_1":
        assert cuts("lm_head.weight") == [(0, 0), (160, 0)]
    assert run(["reshard", "--checkpoint", str(tmp_path / "c2"), "--output", str(tmp_path / "back"),
                "--tensor-parallel", "1", "--pipeline-parallel", "1", "--quiet"]) == 0
    assert run(["export", "--format", "hf", "--checkpoint", str(tmp_path / "back"), "--output",
                str(tmp_path / "out"), "--quiet"]) == 0
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == (tmp_path / "hf" / "model.safetensors").read_bytes()
    assert (tmp_path / "out" / "spiece.model").read_bytes() == spiece
    for name in ("config.json", "generation_config.json"):  # byte for byte (the version it reproduces)
        theirs = (tmp_path / "hf" / name).read_text().replace(transformers.__version__, TRANSFORMERS_VERSION)
        assert (tmp_path / "out" / name).read_text() == theirs, name
    again = transformers.T5ForConditionalGeneration.from_pretrained(tmp_path / "out").eval()
    ids, labels = torch.randint(1, 300, (2, 9)), torch.randint(1, 300, (2, 5))
    with torch.no_grad():
        want = hf(input_ids=ids, labels=labels).logits
        got = again(input_ids=ids, labels=labels).logits
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_t5_import_of_an_mlp_tessera_lacks_and_a_pipeline_reshard_are_refused_in_one_line(tmp_path, capsys):
    import json

    from tessera.ckpt_convert.cli import main

    def cli(argv: list[str]) -> str:
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and "Traceback" not in err, err
        return err

    hf_t5("t5").save_pretrained(tmp_path / "hf")
    assert run(["import", "--format", "hf", "--input", str(tmp_path / "hf"), "--output", str(tmp_path / "c1"),
                "--quiet"]) == 0
    capsys.readouterr()
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "feed_forward_proj": "gated-silu"}))
    err = cli(["import", "--format", "hf", "--input", str(tmp_path / "hf"), "--output", str(tmp_path / "bad"), "--quiet"])
    assert "config.json: field 'feed_forward_proj' = 'gated-silu' is not supported" in err, err
    err = cli(["reshard", "--checkpoint", str(tmp_path / "c1"), "--output", str(tmp_path / "pp"),
               "--tensor-parallel", "1", "--pipeline-parallel", "2", "--quiet"])
    assert "--pipeline-parallel 2" in err and "encoder-decoder" in err, err
    assert not (tmp_path / "bad").exists() and not (tmp_path / "pp").exists()


def test_a_t5_v1_1_saved_as_transformers_4_did_imports_with_its_own_unscaled_head_and_the_aliases_unread(
        tmp_path, tokenizer_dir):
    """google/t5-v1_1-* on the Hub: `tie_word_embeddings: false`, no `scale_decoder_outputs`, and
    the encoder's and decoder's `embed_tokens` saved beside `shared`."""
    import json

    import transformers
    from safetensors.torch import load_file, save_file

    hf = hf_t5("v1_1")
    hf.save_pretrained(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config["tie_word_embeddings"] = False
    del config["scale_decoder_outputs"]
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    tensors = load_file(tmp_path / "hf" / "model.safetensors")
    tensors["encoder.embed_tokens.weight"] = tensors["decoder.embed_tokens.weight"] = tensors["shared.weight"]
    save_file({k: v.clone() for k, v in tensors.items()}, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    for f in tokenizer_dir.iterdir():
        (tmp_path / "hf" / f.name).write_bytes(f.read_bytes())
    assert run(["import", "--format", "hf", "--input", str(tmp_path / "hf"), "--output", str(tmp_path / "c1"),
                "--quiet"]) == 0
    cfg = read_sidecar(resolve_checkpoint(tmp_path / "c1")).model
    assert not cfg.tie_word_embeddings and not cfg.scales_head
    assert run(["export", "--format", "hf", "--checkpoint", str(tmp_path / "c1"), "--output", str(tmp_path / "out"),
                "--quiet"]) == 0
    again = transformers.T5ForConditionalGeneration.from_pretrained(tmp_path / "out").eval()
    ids, labels = torch.randint(1, 300, (2, 9)), torch.randint(1, 300, (2, 5))
    with torch.no_grad():
        torch.testing.assert_close(again(input_ids=ids, labels=labels).logits, hf(input_ids=ids, labels=labels).logits,
                                   rtol=0, atol=0)
