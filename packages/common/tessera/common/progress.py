"""Progress for long CLI work: a live bar on a terminal, plain periodic lines in a log file.

Under SLURM or `cmd > log 2>&1` a tqdm bar writes a `\\r` frame per refresh into the log: thousands
of unreadable partial lines. `progress(...)` gives a tqdm bar only when its stream is a terminal;
otherwise a `PlainProgress` with the same small interface (update, set_postfix, write, close,
iteration, context manager) that prints one complete line every `interval` seconds (and one at the
end): `tokenizing: 1.2 GiB/4.0 GiB (30%), 45 s elapsed, ETA 105 s, docs=12000`.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any, TextIO

PLAIN_INTERVAL_S = 30.0


def _amount(n: float, unit: str, binary: bool) -> str:
    if not binary:
        return f"{n:,.0f}"
    for prefix in ("", "Ki", "Mi", "Gi", "Ti"):
        if abs(n) < 1024 or prefix == "Ti":
            return f"{n:.1f} {prefix}{unit}" if prefix else f"{n:.0f} {unit}"
        n /= 1024
    return f"{n:.1f} {unit}"


class PlainProgress:
    """Line-per-interval progress for non-terminal output (see the module docstring)."""

    def __init__(self, iterable: Iterable | None = None, total: float | None = None, desc: str = "",
                 unit: str = "it", unit_scale: bool = False, file: TextIO | None = None,
                 interval: float = PLAIN_INTERVAL_S, initial: float = 0, **_: Any):
        self.iterable = iterable
        if total is None and iterable is not None and hasattr(iterable, "__len__"):
            total = len(iterable)  # type: ignore[arg-type]
        self.total, self.desc, self.unit, self.binary = total, desc, unit, unit_scale
        self.file = file or sys.stderr
        self.interval = interval
        self.n = initial
        self.postfix = ""
        self.start = self._last = time.monotonic()
        self.closed = False

    def update(self, n: float = 1) -> None:
        self.n += n
        now = time.monotonic()
        if now - self._last >= self.interval:
            self._last = now
            self._line(now)

    def set_postfix(self, ordered_dict: dict | None = None, refresh: bool = True, **kwargs: Any) -> None:
        items = {**(ordered_dict or {}), **kwargs}
        self.postfix = ", ".join(f"{k}={v}" for k, v in items.items())

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        self.postfix = s

    def write(self, line: str) -> None:
        print(line, file=self.file, flush=True)

    def _line(self, now: float) -> None:
        elapsed = now - self.start
        done = _amount(self.n, self.unit, self.binary)
        parts = [f"{self.desc}: " if self.desc else ""]
        if self.total:
            frac = min(self.n / self.total, 1.0)
            parts.append(f"{done}/{_amount(self.total, self.unit, self.binary)} {'' if self.binary else self.unit} "
                         f"({frac:.0%})".replace("  ", " "))
            eta = elapsed / frac - elapsed if frac > 0 else None
            parts.append(f", {elapsed:.0f} s elapsed" + (f", ETA {eta:.0f} s" if eta is not None else ""))
        else:
            parts.append(f"{done} {'' if self.binary else self.unit}".rstrip() + f", {elapsed:.0f} s elapsed")
        if self.postfix:
            parts.append(f", {self.postfix}")
        print("".join(parts), file=self.file, flush=True)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self.n:
                self._line(time.monotonic())

    def __iter__(self) -> Iterator:
        assert self.iterable is not None
        for item in self.iterable:
            yield item
            self.update(1)
        self.close()

    def __enter__(self) -> PlainProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def progress(iterable: Iterable | None = None, *, quiet: bool = False, file: TextIO | None = None, **kwargs: Any) -> Any:
    """A tqdm bar on a terminal, PlainProgress lines otherwise, nothing with `quiet` (a disabled tqdm).

    kwargs are tqdm's (total, desc, unit, unit_scale, initial, ...)."""
    from tqdm import tqdm

    stream = file or sys.stderr
    if quiet:
        return tqdm(iterable, disable=True, **kwargs)
    if getattr(stream, "isatty", lambda: False)():
        kwargs.setdefault("dynamic_ncols", True)
        if kwargs.get("unit_scale") and kwargs.get("unit") == "B":
            kwargs.setdefault("unit_divisor", 1024)
        return tqdm(iterable, file=stream, **kwargs)
    kwargs.pop("dynamic_ncols", None)
    kwargs.pop("unit_divisor", None)
    kwargs.pop("mininterval", None)
    return PlainProgress(iterable, file=stream, **kwargs)
