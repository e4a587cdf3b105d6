"""Progress output fit for batch-job logs: whole periodic lines in a file, a live bar on a terminal."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

from tessera.common.progress import PlainProgress, progress

BIN = Path(sys.executable).parent


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_log_file_gets_whole_lines_with_percent_elapsed_and_eta():
    out = io.StringIO()
    bar = progress(total=4 * 1024**2, desc="tokenizing", unit="B", unit_scale=True, file=out)
    assert isinstance(bar, PlainProgress)
    bar.interval = 0.0  # a line per update here; 30 s in real runs
    bar.set_postfix(docs=12)
    bar.update(1024**2)
    bar.close()
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert lines[0].startswith("tokenizing: 1.0 MiB/4.0 MiB (25%)"), lines
    assert "elapsed" in lines[0] and "ETA" in lines[0] and "docs=12" in lines[0]
    assert lines[-1].startswith("tokenizing: 1.0 MiB/4.0 MiB (25%)")


def test_lines_come_once_per_interval_not_per_update():
    out = io.StringIO()
    bar = progress(range(1000), desc="building indices", unit="index", file=out)
    assert list(bar) == list(range(1000))
    assert out.getvalue().splitlines() == [out.getvalue().splitlines()[-1]]  # only the closing line
    assert "1,000/1,000 index (100%)" in out.getvalue()


def test_a_terminal_gets_a_tqdm_bar_and_quiet_gets_nothing():
    from tqdm import tqdm

    assert isinstance(progress(total=3, file=_Terminal()), tqdm)
    out = io.StringIO()
    quiet = progress(total=3, quiet=True, file=out)
    quiet.update(3)
    quiet.close()
    assert out.getvalue() == ""


def test_prep_writes_no_carriage_returns_into_a_log(tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"line {i} " * 20}) + "\n" for i in range(200)))
    with open(tmp_path / "log", "w") as log:
        subprocess.run([str(BIN / "tessera-data"), "prep", "--input", str(corpus), "--train-tokenizer",
                        "--vocab-size", "300", "--output-prefix", str(tmp_path / "o" / "x")],
                       stdout=log, stderr=subprocess.STDOUT, check=True, timeout=300)
    text = (tmp_path / "log").read_text()
    assert "\r" not in text and "documents" in text
