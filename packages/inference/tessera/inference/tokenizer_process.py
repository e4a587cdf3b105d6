"""Tokenizing long texts in child processes, so the HTTP process's GIL stays free for /health.

The tokenizers library releases the GIL for most of `encode_batch`, but not all of it (turning
the Python string into Rust's and the result back into Python objects), and a 3.9 MB prompt
takes seconds to tens of seconds of it on a loaded machine; /health and open streams wait
for each held stretch (measured in docs/security.md). Texts of
`LONG_TEXT_CHARS` characters or more are sent to one of a few child processes instead; each
loads the tokenizer once (sent as its JSON: the child needs no path) and answers with the ids,
or with only their count when there are more than the caller accepts (a too-long prompt costs
no transfer of a million ids back). Shorter texts stay on the server's threads, where the
GIL-held part of their encode is short and a round trip to a child would cost more; the
threshold is a judgement (1/64 of the default 4 MiB body limit), not a measured optimum.

Started on demand: no child runs until a long text needs one (most servers never see a 64 Ki
character prompt); the request that finds no idle child starts one and pays its start (a fraction
of a second, see below). Bounded: at most as many processes as the server has tokenizer threads
(each thread waits on at most one job); a job that outlasts `timeout_s`, or a child that dies,
ends that request with `TokenizerUnavailable` and the child is replaced. `close` at server exit
ends every child, idle or busy.

A child is `python -m tessera.inference.tokenizer_process FD`, talking over a socket pair in
plain bytes (UTF-8 text in, little-endian int32 ids out), as the engine process talks JSON: no
pickle crosses, so a child that misbehaves on hostile text cannot run code in the server. Not
multiprocessing: its spawn re-runs the parent's main script in the child (any program that
embeds the server without a `__main__` guard would start itself again) and unpickles what it
is sent. This module imports only the standard library (and `tokenizers` in the child), so a
child starts in a fraction of a second.
"""

from __future__ import annotations

import array
import os
import queue
import socket
import struct
import subprocess
import sys
import threading
from multiprocessing.connection import Connection

LONG_TEXT_CHARS = 65_536
_REQUEST = struct.Struct("<?q")  # add_special_tokens, limit (-1: none); the UTF-8 text follows
_COUNT = struct.Struct("<q")  # the number of ids; the ids follow unless there are more than the limit


class TokenizerUnavailable(Exception):
    """No tokenizer process answered in time (busy, stuck, or dead)."""


def _serve(conn: Connection) -> None:
    """The child's loop: the tokenizer's JSON first, then one answer per request."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_str(conn.recv_bytes().decode())
    while True:
        try:
            message = conn.recv_bytes()
        except (EOFError, OSError):  # the server went away
            return
        add_special_tokens, limit = _REQUEST.unpack_from(message)
        ids = tokenizer.encode(message[_REQUEST.size:].decode(), add_special_tokens=add_special_tokens).ids
        within = limit < 0 or len(ids) <= limit
        conn.send_bytes(_COUNT.pack(len(ids)) + (array.array("i", ids).tobytes() if within else b""))


class _Child:
    def __init__(self, tokenizer_json: bytes):
        ours, theirs = socket.socketpair()
        # One thread per child (tokenizers would otherwise spread one encode over every core and
        # take them from the server process and the engine).
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "RAYON_NUM_THREADS": "1"}
        self.process = subprocess.Popen([sys.executable, "-m", __name__, str(theirs.fileno())],
                                        pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
                                        stdout=subprocess.DEVNULL, env=env)
        theirs.close()
        self.conn = Connection(ours.detach())
        self.conn.send_bytes(tokenizer_json)

    def encode(self, text: str, add_special_tokens: bool, limit: int | None, timeout_s: float) -> list[int] | int:
        # The socket write releases the GIL; so does the wait.
        self.conn.send_bytes(_REQUEST.pack(add_special_tokens, -1 if limit is None else limit) + text.encode())
        if not self.conn.poll(timeout_s):
            raise TimeoutError
        answer = self.conn.recv_bytes()
        (count,) = _COUNT.unpack_from(answer)
        if len(answer) == _COUNT.size and count:
            return count
        return array.array("i", answer[_COUNT.size:]).tolist()

    def close(self) -> None:
        self.conn.close()
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=5)


class TokenizerProcesses:
    """Up to `processes` tokenizer child processes, each started when a job first finds none idle
    and then used one job at a time. Thread-safe: the tokenizer threads call `encode` at once."""

    def __init__(self, tokenizer_json: str, processes: int, timeout_s: float):
        self._json = tokenizer_json.encode()
        self.timeout_s = timeout_s
        self._max = processes
        self._idle: queue.Queue[_Child] = queue.Queue()
        self._lock = threading.Lock()  # guards _running and _closed
        self._running: set[_Child] = set()  # every child started and not yet closed, idle or busy
        self._closed = False

    @property
    def num_processes(self) -> int:
        """Children running now (idle or busy)."""
        with self._lock:
            return len(self._running)

    def _take(self) -> _Child:
        """An idle child, else a new one while fewer than `processes` run, else the first to come
        back within `timeout_s`."""
        try:
            return self._idle.get_nowait()
        except queue.Empty:
            pass
        with self._lock:
            if self._closed:
                raise TokenizerUnavailable("the server is shutting down")
            start = len(self._running) < self._max
            if start:
                child = _Child(self._json)  # under the lock: never more than `processes` children
                self._running.add(child)
        if start:
            return child
        try:
            return self._idle.get(timeout=self.timeout_s)
        except queue.Empty:
            raise TokenizerUnavailable(f"every tokenizer process stayed busy for {self.timeout_s:g} s") from None

    def _give_back(self, child: _Child, broken: bool) -> None:
        """Back to the idle queue; a broken child is closed and replaced (a job may be waiting for
        one); after `close`, closed."""
        with self._lock:  # so that `close` cannot drain the idle queue between the check and the put
            if not broken and not self._closed:
                self._idle.put(child)
                return
            self._running.discard(child)
            if not self._closed:
                replacement = _Child(self._json)
                self._running.add(replacement)
                self._idle.put(replacement)
        child.close()

    def encode(self, text: str, add_special_tokens: bool, limit: int | None = None) -> list[int] | int:
        """The ids of `text`, or their count when it exceeds `limit`. Blocks the calling thread (not
        the GIL) for at most twice `timeout_s`: waiting for a free child, then for its answer."""
        child = self._take()
        broken = False
        try:
            return child.encode(text, add_special_tokens, limit, self.timeout_s)
        except (TimeoutError, EOFError, OSError) as exc:
            broken = True  # stuck or dead: replaced, so the next job finds a working one
            what = f"took longer than {self.timeout_s:g} s" if isinstance(exc, TimeoutError) else "failed"
            raise TokenizerUnavailable(f"tokenizing the text {what}") from None
        finally:
            self._give_back(child, broken)

    def close(self) -> None:
        """End every child: the idle ones now, a busy one when its job comes back."""
        idle = []
        with self._lock:
            self._closed = True
            while not self._idle.empty():
                idle.append(self._idle.get_nowait())
            self._running.difference_update(idle)
        for child in idle:
            child.close()


if __name__ == "__main__":
    _serve(Connection(int(sys.argv[1])))
