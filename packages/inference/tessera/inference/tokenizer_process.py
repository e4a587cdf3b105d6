"""Tokenizing long texts in child processes, so the HTTP process's GIL stays free for /health.

The tokenizers library releases the GIL for most of `encode_batch`, but not all of it (turning
the Python string into Rust's and the result back into Python objects): a 3.9 MB prompt
tokenized on a thread of the server kept /health waiting up to 247 ms. Texts of
`LONG_TEXT_CHARS` characters or more are sent to one of a few child processes instead; each
loads the tokenizer once (from its JSON, so `spawn` needs no path) and answers with the ids, or
with only their count when there are more than the caller accepts (a too-long prompt costs no
transfer of a million ids back). Shorter texts stay on the server's threads: at ~60 ns of GIL
per character they hold it for at most a few milliseconds, less than a round trip costs.

Bounded: as many processes as the server has tokenizer threads (each thread waits on at most
one job); a job that outlasts `timeout_s`, or a child that dies, ends that request with
`TokenizerUnavailable` and the child is replaced. This module imports only the standard
library and `tokenizers`, so a spawned child starts in a fraction of a second.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
from multiprocessing.connection import Connection

LONG_TEXT_CHARS = 65_536


class TokenizerUnavailable(Exception):
    """No tokenizer process answered in time (busy, stuck, or dead)."""


def _serve(conn: Connection, tokenizer_json: str) -> None:
    """The child's loop: (text, add_special_tokens, limit) in, ids (or their count if > limit) out."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_str(tokenizer_json)
    while True:
        try:
            text, add_special_tokens, limit = conn.recv()
        except (EOFError, OSError):  # the server went away
            return
        ids = tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        conn.send(ids if limit is None or len(ids) <= limit else len(ids))


class _Child:
    def __init__(self, ctx, tokenizer_json: str):
        self.conn, child_end = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(child_end, tokenizer_json), daemon=True,
                                   name="tessera-tokenizer")
        self.process.start()
        child_end.close()

    def encode(self, text: str, add_special_tokens: bool, limit: int | None, timeout_s: float) -> list[int] | int:
        self.conn.send((text, add_special_tokens, limit))  # the pipe write releases the GIL
        if not self.conn.poll(timeout_s):
            raise TimeoutError
        return self.conn.recv()

    def close(self) -> None:
        self.conn.close()
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=5)


class TokenizerProcesses:
    """A fixed set of tokenizer child processes, started at once and used one job at a time each."""

    def __init__(self, tokenizer_json: str, processes: int, timeout_s: float):
        self._ctx = mp.get_context("spawn")  # no fork of a threaded server process
        self._json = tokenizer_json
        self.timeout_s = timeout_s
        self._idle: queue.Queue[_Child] = queue.Queue()
        for _ in range(processes):
            self._idle.put(_Child(self._ctx, tokenizer_json))

    def encode(self, text: str, add_special_tokens: bool, limit: int | None = None) -> list[int] | int:
        """The ids of `text`, or their count when it exceeds `limit`. Blocks the calling thread (not
        the GIL) for at most twice `timeout_s`: waiting for a free child, then for its answer."""
        try:
            child = self._idle.get(timeout=self.timeout_s)
        except queue.Empty:
            raise TokenizerUnavailable(f"every tokenizer process stayed busy for {self.timeout_s:g} s") from None
        try:
            return child.encode(text, add_special_tokens, limit, self.timeout_s)
        except (TimeoutError, EOFError, OSError) as exc:
            child.close()  # stuck or dead: replace it so the next request finds a working one
            child = _Child(self._ctx, self._json)
            what = f"took longer than {self.timeout_s:g} s" if isinstance(exc, TimeoutError) else "failed"
            raise TokenizerUnavailable(f"tokenizing the text {what}") from None
        finally:
            self._idle.put(child)

    def close(self) -> None:
        while True:
            try:
                self._idle.get_nowait().close()
            except queue.Empty:
                return
