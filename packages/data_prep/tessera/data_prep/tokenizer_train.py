"""Training a tokenizer with Hugging Face `tokenizers`, saved as transformers expects: byte-level
BPE (decoders), or WordPiece as BERT's (encoders: `--tokenizer-type wordpiece`).

The directory it writes loads with `tokenizers.Tokenizer.from_file`, with transformers'
`AutoTokenizer.from_pretrained` (PreTrainedTokenizerFast) and with `tessera.common.tokenizer`:

    tokenizer.json           the tokenizer itself (byte-level pre-tokenizer and decoder, BPE model)
    tokenizer_config.json    special tokens, tokenizer_class, model_max_length, chat_template
    special_tokens_map.json  the special tokens again, for older transformers readers
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

from tessera.common.fileio import atomic_directory

EOD_TOKEN = "<|endoftext|>"  # end of document; also eos and pad
BOS_TOKEN = "<|begin_of_text|>"
SPECIAL_TOKENS = (EOD_TOKEN, BOS_TOKEN)

# A plain role-tagged transcript. Each turn ends with eos, so a model trained on such text stops
# after its answer; `add_generation_prompt` opens the assistant's turn. Tool use as the server's
# Hermes parser reads it back (inference/tools.py): the tools, when given, in a system turn first;
# an assistant's calls (its content may be null) as <tool_call>{"name", "arguments"}</tool_call>
# after its text; a tool's result as a `tool` turn. Without tools the text is what earlier versions
# rendered, byte for byte.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}"
    "{{ '<|system|>\\nYou can call these tools. To call one, answer with <tool_call>{\"name\": the tool\\'s name, "
    "\"arguments\": a JSON object}</tool_call>.\\n<tools>\\n' }}"
    "{% for tool in tools %}{{ (tool | tojson) + '\\n' }}{% endfor %}"
    "{{ '</tools>' + eos_token + '\\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + (message['content'] or '') }}"
    "{% for call in message['tool_calls'] or [] %}"
    "{{ '<tool_call>' + ({'name': call['function']['name'], 'arguments': call['function']['arguments']} | tojson)"
    " + '</tool_call>' }}"
    "{% endfor %}"
    "{{ eos_token + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


def train_bpe(texts: Iterable[str], vocab_size: int, min_frequency: int = 2, length: int | None = None):
    """Train a byte-level BPE on `texts`; returns a `tokenizers.Tokenizer`.

    The 256 byte symbols are always in the vocabulary, so any input, in any language or binary
    junk, encodes without unknown tokens.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer, length=length)
    return tokenizer


# BERT's special tokens, in the order BERT's own trained tokenizers give them ids 0..4.
WORDPIECE_SPECIALS = {"pad_token": "[PAD]", "unk_token": "[UNK]", "cls_token": "[CLS]", "sep_token": "[SEP]",
                      "mask_token": "[MASK]"}


def bert_pipeline(tokenizer, lowercase: bool) -> None:
    """BERT's normalizer (clean text, CJK characters split, lowercase and strip accents when
    uncased), pre-tokenizer, WordPiece decoder and `[CLS] A [SEP] B [SEP]` template, as
    transformers' BertTokenizer builds them."""
    from tokenizers import decoders, normalizers, pre_tokenizers

    tokenizer.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True, strip_accents=None,
                                                      lowercase=lowercase)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece(prefix="##")


def bert_post_processor(tokenizer) -> None:
    from tokenizers import processors

    cls, sep = WORDPIECE_SPECIALS["cls_token"], WORDPIECE_SPECIALS["sep_token"]
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{cls} $A {sep}", pair=f"{cls} $A {sep} $B:1 {sep}:1",
        special_tokens=[(cls, tokenizer.token_to_id(cls)), (sep, tokenizer.token_to_id(sep))])


def add_sentinels(tokenizer, count: int) -> list[str]:
    """Append T5's sentinel tokens as special tokens, `<extra_id_{count-1}>` first, so that
    `<extra_id_0>` is the last id and sentinel i is vocab_size - 1 - i (T5's layout, which its span
    corruption counts down from). Returns them in id order."""
    tokens = [f"<extra_id_{i}>" for i in reversed(range(count))]
    if tokens:
        from tokenizers import AddedToken

        tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in tokens])
    return tokens


def train_wordpiece(texts: Iterable[str], vocab_size: int, lowercase: bool = True, min_frequency: int = 2,
                    length: int | None = None):
    """Train a WordPiece vocabulary (BERT's `##` continuation prefix and special tokens) on `texts`."""
    from tokenizers import Tokenizer, models, trainers

    tokenizer = Tokenizer(models.WordPiece(unk_token=WORDPIECE_SPECIALS["unk_token"]))
    bert_pipeline(tokenizer, lowercase)
    trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                        special_tokens=list(WORDPIECE_SPECIALS.values()),
                                        continuing_subword_prefix="##", show_progress=False)
    tokenizer.train_from_iterator(texts, trainer=trainer, length=length)
    bert_post_processor(tokenizer)
    return tokenizer


def wordpiece_config(model_max_length: int, lowercase: bool) -> dict:
    """tokenizer_config.json of a BERT tokenizer (transformers' BertTokenizer reads it)."""
    return {"tokenizer_class": "BertTokenizer", "do_lower_case": lowercase, **WORDPIECE_SPECIALS,
            "model_max_length": model_max_length, "clean_up_tokenization_spaces": True}


def save_wordpiece(tokenizer, directory: str | os.PathLike, model_max_length: int, lowercase: bool,
                   overwrite: bool = False) -> Path:
    """Write a WordPiece tokenizer directory atomically: tokenizer.json, tokenizer_config.json,
    special_tokens_map.json and BERT's vocab.txt (ids in line order)."""
    directory = Path(directory)
    vocab = sorted(tokenizer.get_vocab(with_added_tokens=True).items(), key=lambda kv: kv[1])
    with atomic_directory(directory, overwrite=overwrite) as tmp:
        tokenizer.save(str(tmp / "tokenizer.json"))
        (tmp / "tokenizer_config.json").write_text(
            json.dumps(wordpiece_config(model_max_length, lowercase), indent=2, sort_keys=True) + "\n")
        (tmp / "special_tokens_map.json").write_text(json.dumps(WORDPIECE_SPECIALS, indent=2, sort_keys=True) + "\n")
        (tmp / "vocab.txt").write_text("".join(token + "\n" for token, _ in vocab), encoding="utf-8")
    return directory


def tokenizer_config(model_max_length: int) -> dict:
    added = {}
    for i, token in enumerate(SPECIAL_TOKENS):
        added[str(i)] = {"content": token, "lstrip": False, "normalized": False, "rstrip": False,
                         "single_word": False, "special": True}
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOD_TOKEN,
        "pad_token": EOD_TOKEN,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": added,
    }


def save_tokenizer(tokenizer, directory: str | os.PathLike, model_max_length: int, overwrite: bool = False) -> Path:
    """Write the tokenizer directory atomically (a half-written tokenizer never appears)."""
    directory = Path(directory)
    config = tokenizer_config(model_max_length)
    special_map = {"bos_token": BOS_TOKEN, "eos_token": EOD_TOKEN, "pad_token": EOD_TOKEN}
    with atomic_directory(directory, overwrite=overwrite) as tmp:
        tokenizer.save(str(tmp / "tokenizer.json"))
        (tmp / "tokenizer_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        (tmp / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2, sort_keys=True) + "\n")
    return directory
