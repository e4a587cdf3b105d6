"""Sentence splitting for `tessera-data prep --split-sentences` (Megatron's preprocess_data.py
--split-sentences): each document becomes one sequence per sentence in the `.idx`, the document
index grouping them, which is what BERT's sentence-pair samples are cut from.

Megatron splits with NLTK's punkt, whose model is a separate download at run time; pysbd (rule
based, no data files, many languages) does the same job from its wheel alone: the optional extra
`tessera-data-prep[sentences]`. Sentences keep their surrounding whitespace (`clean=False`), so
the concatenated sentences are the document's text and a byte-level tokenizer sees it unchanged.
"""

from __future__ import annotations

import importlib
from functools import lru_cache

from tessera.common.errors import UserError


def check_splitter(language: str) -> None:
    """One line when pysbd is missing or does not know `language` (checked before any work)."""
    try:
        pysbd = importlib.import_module("pysbd")
    except ImportError:
        raise UserError("--split-sentences needs pysbd; install tessera-data-prep[sentences] "
                        "(pip install pysbd)") from None
    try:
        pysbd.Segmenter(language=language, clean=False)
    except ValueError:
        from pysbd.languages import LANGUAGE_CODES

        raise UserError(f"--sentence-language {language!r}: pysbd has no rules for it; use one of "
                        f"{', '.join(sorted(LANGUAGE_CODES))}") from None


@lru_cache(maxsize=4)
def _segmenter(language: str):
    import pysbd

    return pysbd.Segmenter(language=language, clean=False)


def split_sentences(text: str, language: str = "en") -> list[str]:
    """The sentences of `text`, whitespace kept; blank pieces dropped (they tokenize to nothing)."""
    return [s for s in _segmenter(language).segment(text) if s.strip()]
