"""BERT through `tessera-ckpt` and Hugging Face: random tiny BertModel, BertForMaskedLM and
BertForPreTraining made here with transformers; import -> reshard TP2 x PP2 -> reshard back ->
export gives transformers' model.safetensors byte for byte and a config.json transformers reads as
the same config (and no generation_config.json: an encoder does not generate)."""

from __future__ import annotations

import json

import pytest
import torch

from tessera.ckpt_convert.cli import run
from tessera.common.checkpoint import read_sidecar, resolve_checkpoint

VOCAB = 320  # the tokenizer fixture's 300 tokens fit; divisible by 2 for TP2


def hf_bert(cls: str):
    """A transformers BERT whose biases and norms are drawn at random, so a dropped or swapped one
    changes the bytes."""
    import transformers

    torch.manual_seed(0)
    config_class = transformers.MegatronBertConfig if cls.startswith("Megatron") else transformers.BertConfig
    config = config_class(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64, max_position_embeddings=40, type_vocab_size=2,
                                     pad_token_id=2)
    model = getattr(transformers, cls)(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.normal_(1.0 if ("LayerNorm.weight" in name or "ln.weight" in name) else 0.0, 0.2)
    return model.eval()


@pytest.mark.parametrize("cls", ["BertModel", "BertForMaskedLM", "BertForPreTraining", "MegatronBertForPreTraining"])
def test_bert_import_reshard_to_tp2_pp2_and_back_then_export_gives_transformers_bytes_and_config(
        tmp_path, tokenizer_dir, cls):
    import torch.distributed.checkpoint as dcp
    import transformers

    hf = hf_bert(cls)
    hf.save_pretrained(tmp_path / "hf")
    for f in tokenizer_dir.iterdir():
        (tmp_path / "hf" / f.name).write_bytes(f.read_bytes())
    vocab_txt = "".join(f"{t}\n" for t, _ in sorted(json.loads((tokenizer_dir / "tokenizer.json").read_text())
                                                     ["model"]["vocab"].items(), key=lambda kv: kv[1]))
    (tmp_path / "hf" / "vocab.txt").write_text(vocab_txt)  # a WordPiece directory's vocabulary: carried along
    assert run(["import", "--format", "hf", "--input", str(tmp_path / "hf"), "--output", str(tmp_path / "c11"),
                "--quiet"]) == 0
    assert read_sidecar(resolve_checkpoint(tmp_path / "c11")).model.kind == "encoder"
    assert run(["reshard", "--checkpoint", str(tmp_path / "c11"), "--output", str(tmp_path / "c22"),
                "--tensor-parallel", "2", "--pipeline-parallel", "2", "--quiet"]) == 0
    meta = dcp.FileSystemReader(str(resolve_checkpoint(tmp_path / "c22"))).read_metadata().state_dict_metadata

    def cuts(key: str) -> list[tuple[int, ...]]:
        return sorted(tuple(c.offsets) for c in meta["model." + key].chunks)

    # The split happened as the encoder's plan cuts: q/k/v and up by rows, o/down by columns, the
    # vocabulary by rows (the MLM decoder's bias with it), norms and the pooler whole.
    assert cuts("layers.0.attn.q_proj.weight") == [(0, 0), (16, 0)] and cuts("layers.1.attn.q_proj.bias") == [(0,), (16,)]
    assert cuts("layers.0.mlp.down_proj.weight") == [(0, 0), (0, 32)]
    norm = "final_norm" if cls.startswith("Megatron") else "embed_norm"  # pre-LN (MegatronBert): a final norm
    assert cuts("embed_tokens.weight") == [(0, 0), (160, 0)] and cuts(f"{norm}.weight") == [(0,)]
    if cls != "BertModel":
        assert cuts("mlm_head.decoder.bias") == [(0,), (160,)]
    assert run(["reshard", "--checkpoint", str(tmp_path / "c22"), "--output", str(tmp_path / "back"),
                "--tensor-parallel", "1", "--pipeline-parallel", "1", "--quiet"]) == 0
    assert run(["export", "--format", "hf", "--checkpoint", str(tmp_path / "back"), "--output",
                str(tmp_path / "out"), "--quiet"]) == 0
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == (tmp_path / "hf" / "model.safetensors").read_bytes()
    assert not (tmp_path / "out" / "generation_config.json").exists()
    assert (tmp_path / "out" / "vocab.txt").read_text() == vocab_txt
    from tessera.common.models.encoder.hf.bert import TRANSFORMERS_VERSION

    theirs = (tmp_path / "hf" / "config.json").read_text().replace(transformers.__version__, TRANSFORMERS_VERSION)
    assert (tmp_path / "out" / "config.json").read_text() == theirs  # byte for byte (the version it reproduces)
    again = transformers.AutoConfig.from_pretrained(tmp_path / "out").to_dict()
    assert {k: v for k, v in again.items() if k != "_name_or_path"} == \
        {k: v for k, v in hf.config.to_dict().items() if k != "_name_or_path"}
