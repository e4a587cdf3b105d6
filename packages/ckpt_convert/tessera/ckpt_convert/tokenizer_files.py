"""Copying a checkpoint's tokenizer into an export, in the form transformers' AutoTokenizer loads."""

from __future__ import annotations

import json
from pathlib import Path

from tessera.common.fileio import atomic_write_json, fsync_tree
from tessera.common.tokenizer import TOKENIZER_CONFIG, TOKENIZER_FILES, Tokenizer


def write_hf_tokenizer(tok: Tokenizer, out: Path, sync: bool = True) -> None:
    """tokenizer.json + tokenizer_config.json, and chat_template.jinja when the tokenizer has one
    (chat template and special tokens kept as they are, where transformers reads them).

    transformers needs `tokenizer_class` to pick the fast tokenizer when no slow-tokenizer files
    exist; a config written by plain `tokenizers` training lacks it, so it is added, nothing else.
    """
    tok.save(out)
    cfg_path = out / TOKENIZER_CONFIG
    config = json.loads(cfg_path.read_text(encoding="utf-8")) if cfg_path.is_file() else {}
    if "tokenizer_class" not in config:
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
        atomic_write_json(cfg_path, config, sync=sync)
    if sync:
        fsync_tree(out, [p for p in out.iterdir() if p.name in TOKENIZER_FILES])

