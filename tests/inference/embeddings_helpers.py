"""Embedding-model directories built at test time: a random tiny Qwen3 causal LM saved by
transformers, plus the sentence-transformers module files that declare its pooling."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from inference_helpers import train_tokenizer


def write_st_modules(directory: Path, mode: str, normalize: bool = True, max_seq_length: int | None = 128,
                     dim: int = 64) -> None:
    """modules.json, 1_Pooling/config.json ("cls" | "mean" | "lasttoken"), 2_Normalize and
    sentence_bert_config.json as sentence-transformers saves them."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        (directory / "2_Normalize").mkdir(exist_ok=True)
    (directory / "modules.json").write_text(json.dumps(modules))
    (directory / "1_Pooling").mkdir(exist_ok=True)
    modes = {"cls": "pooling_mode_cls_token", "mean": "pooling_mode_mean_tokens", "lasttoken": "pooling_mode_lasttoken"}
    pool = {"word_embedding_dimension": dim, **{k: k == modes[mode] for k in (*modes.values(), "pooling_mode_max_tokens",
                                                                             "pooling_mode_mean_sqrt_len_tokens",
                                                                             "pooling_mode_weightedmean_tokens")},
            "include_prompt": True}
    (directory / "1_Pooling" / "config.json").write_text(json.dumps(pool))
    if max_seq_length is not None:
        (directory / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_seq_length,
                                                                         "do_lower_case": False}))


def make_qwen3_dir(directory: Path, seed: int = 0) -> Path:
    """A random tiny Qwen3ForCausalLM with our BPE tokenizer, whose post-processor appends
    <|endoftext|> as Qwen3-Embedding's does (the token its last-token pooling reads)."""
    from tokenizers import Tokenizer
    from tokenizers.processors import TemplateProcessing
    from transformers import Qwen3Config, Qwen3ForCausalLM

    train_tokenizer(directory, 512)
    tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
    eos = tok.token_to_id("<|endoftext|>")
    tok.post_processor = TemplateProcessing(single="$A <|endoftext|>", special_tokens=[("<|endoftext|>", eos)])
    tok.save(str(directory / "tokenizer.json"))
    tok_cfg = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({**tok_cfg, "pad_token": "<|endoftext|>"}))
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=256, tie_word_embeddings=False,
                      eos_token_id=eos, bos_token_id=None, pad_token_id=None)
    Qwen3ForCausalLM(cfg).eval().save_pretrained(directory, safe_serialization=True)
    return directory


def pooled_variant(src: Path, dst: Path, mode: str, **kw) -> Path:
    """A copy of `src` (a model directory) declaring `mode` pooling."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("modules.json", "1_Pooling", "2_Normalize",
                                                          "sentence_bert_config.json"))
    write_st_modules(dst, mode, **kw)
    return dst


def st_encode(directory: Path, texts: list[str], batch_size: int = 32):
    """sentence-transformers' own embeddings of `texts` from `directory` (fp32, CPU)."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(directory), device="cpu")
    return model.encode(texts, batch_size=batch_size, convert_to_numpy=True)


def cosines(a, b) -> list[float]:
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return torch.nn.functional.cosine_similarity(a, b, dim=-1).tolist()


def sentences(n: int) -> list[str]:
    """n different short texts of different lengths."""
    words = ("the quick brown fox jumps over a lazy dog while json decoders parse text and wrap lines "
             "of source code into tidy paragraphs").split()
    return [" ".join(words[(i * 7) % len(words):][: 3 + i % 11] + [str(i)]) for i in range(n)]


def make_bert_dir(directory: Path, seed: int = 0, hidden: int = 64, layers: int = 2, positions: int = 256) -> Path:
    """A random tiny BertModel saved by transformers, with a WordPiece tokenizer trained here
    ([CLS] text [SEP], as BERT's post-processor)."""
    from inference_helpers import corpus
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from tokenizers.processors import TemplateProcessing
    from transformers import BertConfig, BertModel

    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.train_from_iterator(corpus(), trainers.WordPieceTrainer(vocab_size=512, special_tokens=special))
    tok.post_processor = TemplateProcessing(single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
                                            special_tokens=[(t, tok.token_to_id(t)) for t in ("[CLS]", "[SEP]")])
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "cls_token": "[CLS]", "sep_token": "[SEP]", "pad_token": "[PAD]", "unk_token": "[UNK]", "mask_token": "[MASK]",
        "tokenizer_class": "PreTrainedTokenizerFast"}))
    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=tok.get_vocab_size(), hidden_size=hidden, num_hidden_layers=layers,
                     num_attention_heads=4, intermediate_size=hidden * 2, max_position_embeddings=positions)
    BertModel(cfg).eval().save_pretrained(directory, safe_serialization=True)
    return directory
