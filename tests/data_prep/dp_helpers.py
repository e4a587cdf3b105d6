"""Helpers shared by the tessera-data tests (a uniquely named module: every test folder has a conftest)."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import pytest

from tessera.data_prep.cli import entry, main


def stdlib_texts(limit: int = 40) -> list[str]:
    """Real text present on every machine: the Python standard library's own modules."""
    root = Path(sysconfig.get_paths()["stdlib"])
    texts = []
    for sub in ("json", "email", "http", "logging", "importlib"):
        for p in sorted((root / sub).glob("*.py")):
            text = p.read_text(encoding="utf-8")
            if text.strip():
                texts.append(text)
    return texts[:limit]


def write_jsonl(path: Path, records: list, raw_lines: dict[int, bytes] | None = None) -> Path:
    """JSONL with one record per line; `raw_lines` inserts literal bytes before the given record index."""
    raw_lines = raw_lines or {}
    with open(path, "wb") as f:
        for i, rec in enumerate(records):
            if i in raw_lines:
                f.write(raw_lines[i] + b"\n")
            f.write(json.dumps(rec).encode() + b"\n")
    return path


def run(argv: list[str]) -> int:
    """Run `tessera-data` in-process (no interpreter start-up per call)."""
    return entry([str(a) for a in argv])


def user_error(argv, capsys) -> str:
    """Run the CLI expecting exit 2; returns its single stderr line."""
    capsys.readouterr()  # drop what earlier calls printed
    with pytest.raises(SystemExit) as exc:
        main([str(a) for a in argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    return err[0]
