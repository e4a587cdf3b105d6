"""Tokenizer work in child processes: long texts tokenized, chat templates rendered, so that the
HTTP process's GIL stays free for /health and a runaway template cannot stall or crash it.

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
of a second, see below; bounded by `timeout_s` like a job: a child that cannot be started, or
does not take the tokenizer in time, is a `TokenizerUnavailable`). Bounded: at most as many
processes as the server has tokenizer threads (each thread waits on at most one job); a job that
outlasts `timeout_s` (sending the text included), or a child that dies, ends that request with
`TokenizerUnavailable` and the child is closed; the next job that finds none idle starts another.
`close` at server exit ends every child at once, idle or busy (a busy one's job then fails).

A child is `python -m tessera.inference.entrypoints.tokenizer_process FD`, talking over a socket pair in
plain bytes (UTF-8 text in, little-endian int32 ids out), as the engine process talks JSON: no
pickle crosses, so a child that misbehaves on hostile text cannot run code in the server. Not
multiprocessing: its spawn re-runs the parent's main script in the child (any program that
embeds the server without a `__main__` guard would start itself again) and unpickles what it
is sent. This module imports only the standard library (and `tokenizers` or the chat template
renderer in the child), so a child starts in a fraction of a second.

Chat templates (`TemplateProcesses`): a template comes with the model and Jinja's sandbox does
not bound what it costs. The renderer bounds loops, sizes and time itself
(tessera.common.chat_template), but a single C-level call inside a filter can still allocate or
run past those checks. So the server renders in children of their own (never the tokenizer
children, so a slow template never delays a long completion prompt), each under an address-space
limit (`RenderLimits.max_memory_mb` above what the interpreter has at start) and killed when a
render outlasts its time limit by `RENDER_GRACE_S`. A render sends the template, its special
tokens and the messages as JSON (a child keeps the last few templates compiled) and gets the
text back.
"""

from __future__ import annotations

import array
import json
import os
import socket
import struct
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection

LONG_TEXT_CHARS = 65_536
RENDER_GRACE_S = 2.0  # past a render's own time limit, before its child is killed
# A render child's start (0.2-0.3 s on the loaded 2-core dev machine) may take this long whatever the
# render limit: a short --chat-template-timeout must not turn every first render into a 503.
TEMPLATE_START_S = 30.0
_TOKENIZER, _TEMPLATE = b"T", b"C"  # what a child serves: the first byte of its first message
_REQUEST = struct.Struct("<?q")  # add_special_tokens, limit (-1: none); the UTF-8 text follows
_COUNT = struct.Struct("<q")  # the number of ids; the ids follow unless there are more than the limit


class TokenizerUnavailable(Exception):
    """No tokenizer process answered in time (busy, stuck, or dead)."""


def _tokenizer_answers(init: bytes):
    """The child's answer to each tokenize request, from the tokenizer's JSON."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_str(init.decode())

    def answer(message: bytes) -> bytes:
        add_special_tokens, limit = _REQUEST.unpack_from(message)
        ids = tokenizer.encode(message[_REQUEST.size:].decode(), add_special_tokens=add_special_tokens).ids
        within = limit < 0 or len(ids) <= limit
        return _COUNT.pack(len(ids)) + (array.array("i", ids).tobytes() if within else b"")
    return answer


def _template_answers(init: bytes):
    """The child's answer to each render request: b"\0" + the text, or b"\1" + a JSON error."""
    import resource

    from tessera.common.chat_template import ChatTemplateError, RenderLimits, render_template

    limits = RenderLimits(**json.loads(init))
    try:
        with open("/proc/self/statm") as f:  # the interpreter's own address space, in pages (Linux)
            base = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        base = None  # elsewhere only the renderer's own checks bound a render's memory
    if base is not None:
        cap = base + limits.max_memory_mb * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

    def answer(message: bytes) -> bytes:
        try:
            request = json.loads(message)
            text = render_template(request["template"], request["special"], request["messages"],
                                   request["add_generation_prompt"], request["variables"], limits)
            return b"\0" + text.encode("utf-8", "surrogatepass")  # the server refuses lone surrogates itself
        except ChatTemplateError as exc:
            return b"\1" + json.dumps({"message": str(exc), "limit": getattr(exc, "limit", None)}).encode()
        except MemoryError:  # outside the render (decoding the request, encoding the text)
            return b"\1" + json.dumps({"message": "the chat template ran out of memory while rendering",
                                        "limit": "max_memory_mb"}).encode()
        except Exception as exc:  # e.g. messages nested past json's recursion limit
            return b"\1" + json.dumps({"message": f"chat template failed: {type(exc).__name__}", "limit": None}).encode()
    return answer


def _serve(conn: Connection) -> None:
    """The child's loop: what it serves first (answered with an empty ready message), then one
    answer per request."""
    init = conn.recv_bytes()
    answer = (_tokenizer_answers if init[:1] == _TOKENIZER else _template_answers)(init[1:])
    conn.send_bytes(b"")  # ready
    while True:
        try:
            message = conn.recv_bytes()
        except (EOFError, OSError):  # the server went away
            return
        conn.send_bytes(answer(message))


class _Child:
    # What runs in the child; the socket's file descriptor is appended (a test swaps this for a
    # program that fails to start or never answers).
    command = [sys.executable, "-m", __name__]

    def __init__(self, init: bytes, timeout_s: float):
        """Start the child and hand it what it serves, within `timeout_s`: `init` (a tokenizer's JSON
        is several MB) is sent and the child's ready message awaited (TimeoutError, or EOFError if it exits first;
        OSError if it cannot be started at all); on failure nothing is left running."""
        ours, theirs = socket.socketpair()
        # One thread per child (tokenizers would otherwise spread one encode over every core and
        # take them from the server process and the engine).
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "RAYON_NUM_THREADS": "1"}
        try:
            self.process = subprocess.Popen([*self.command, str(theirs.fileno())], pass_fds=[theirs.fileno()],
                                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, env=env)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self.conn = Connection(ours.detach())
        try:
            deadline = time.monotonic() + timeout_s
            self._send(init, timeout_s)
            if not self.conn.poll(max(0.0, deadline - time.monotonic())):
                raise TimeoutError
            self.conn.recv_bytes()  # ready
        except TimeoutError:  # an OSError: before the clause below
            self.close()
            raise
        except (OSError, EOFError):  # it exited: EOF, or EPIPE / ECONNRESET on the write, by timing
            self.close()
            raise EOFError from None
        except BaseException:
            self.close()
            raise

    def _send(self, data: bytes, timeout_s: float) -> None:
        """conn.send_bytes bounded by `timeout_s`: a write blocks while the child is not reading,
        so it runs on a thread of its own, and a child that has not taken it all in time is killed
        (which ends the write) and TimeoutError raised. The write releases the GIL."""
        failed: list[OSError] = []

        def send() -> None:
            try:
                self.conn.send_bytes(data)
            except OSError as exc:  # the child died (or was killed below)
                failed.append(exc)

        sender = threading.Thread(target=send, name="tessera-tokenizer-send", daemon=True)
        sender.start()
        sender.join(timeout_s)
        if sender.is_alive():
            self.kill()
            sender.join()
            raise TimeoutError
        if failed:
            raise failed[0]

    def request(self, message: bytes, timeout_s: float) -> bytes:
        """The child's answer within `timeout_s` (sending and waiting), else TimeoutError."""
        deadline = time.monotonic() + timeout_s
        self._send(message, timeout_s)
        if not self.conn.poll(max(0.0, deadline - time.monotonic())):
            raise TimeoutError
        return self.conn.recv_bytes()

    def kill(self) -> None:
        """End the process only; a thread waiting on its socket then reads EOF (see `close`)."""
        if self.process.poll() is None:
            self.process.kill()

    def close(self) -> None:
        self.conn.close()
        self.kill()
        self.process.wait(timeout=5)


def _start_problem(exc: BaseException, timeout_s: float, what: str) -> str:
    if isinstance(exc, TimeoutError):
        return f"it did not take {what} within {timeout_s:g} s"
    if isinstance(exc, EOFError):
        return f"it exited before taking {what}"
    return " ".join(str(exc).split()) or type(exc).__name__


class ChildProcesses:
    """Up to `processes` child processes serving `init` (see _serve), each started when a job first
    finds none idle and then used one job at a time. Thread-safe: several threads call at once.

    A child is started (and closed) outside the lock: only the slot is reserved under it
    (`_starting`), so a start, which sends megabytes and waits for the child, never holds up the
    other threads' jobs, `num_processes` or `close`."""

    kind, serves = "tokenizer", "the tokenizer"  # for messages: "could not start a tokenizer process"

    def __init__(self, init: bytes, processes: int, timeout_s: float, start_timeout_s: float | None = None):
        self._init = init
        self.timeout_s = timeout_s
        self.start_timeout_s = start_timeout_s or timeout_s  # a child's start, and taking `init`
        self._max = processes
        self._changed = threading.Condition()  # guards everything below; notified when a child or slot frees
        self._idle: list[_Child] = []
        self._busy: set[_Child] = set()  # running a job now: `close` kills them
        self._running: set[_Child] = set()  # every child started and not yet closed, idle or busy
        self._starting = 0  # slots reserved by starts under way (outside the lock)
        self._closed = False

    @property
    def num_processes(self) -> int:
        """Children running now (idle or busy)."""
        with self._changed:
            return len(self._running)

    def _take(self) -> _Child:
        """An idle child, else a new one while fewer than `processes` run or start, else the first
        to come back (or slot to free) within `timeout_s`."""
        deadline = time.monotonic() + self.timeout_s
        with self._changed:
            while True:
                if self._closed:
                    raise TokenizerUnavailable("the server is shutting down")
                if self._idle:
                    child = self._idle.pop()
                    self._busy.add(child)
                    return child
                if len(self._running) + self._starting < self._max:
                    self._starting += 1  # never more than `processes` children, started or starting
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TokenizerUnavailable(f"every {self.kind} process stayed busy for {self.timeout_s:g} s")
                self._changed.wait(left)
        return self._start()

    def _start(self) -> _Child:
        """A new child in the slot `_take` reserved, busy; the slot freed whatever happens."""
        try:
            child = _Child(self._init, self.start_timeout_s)
        except (OSError, EOFError, TimeoutError) as exc:
            with self._changed:
                self._starting -= 1
                self._changed.notify()
            problem = _start_problem(exc, self.start_timeout_s, self.serves)
            raise TokenizerUnavailable(f"could not start a {self.kind} process: {problem}") from None
        with self._changed:
            self._starting -= 1
            if not self._closed:
                self._running.add(child)
                self._busy.add(child)
                return child
            self._changed.notify()
        child.close()
        raise TokenizerUnavailable("the server is shutting down")

    def _give_back(self, child: _Child, broken: bool) -> None:
        """Back to the idle list; a broken child (or any after `close`) is closed, outside the lock,
        and its slot freed: the next job that finds no idle child starts a new one."""
        with self._changed:  # so that `close` cannot take the idle list between the check and the append
            self._busy.discard(child)
            self._changed.notify()
            if not broken and not self._closed:
                self._idle.append(child)
                return
            self._running.discard(child)
        child.close()

    def _request(self, message: bytes, job: str) -> bytes:
        """A child's answer to `message`. Blocks the calling thread (not the GIL) for at most about
        twice `timeout_s`: waiting for a free child (or starting one), then for its answer; a
        child that does not answer in time, or dies, is closed and the job is a
        TokenizerUnavailable ("{job} took longer than ..." / "{job} failed")."""
        child = self._take()
        broken = False
        try:
            return child.request(message, self.timeout_s)
        except (TimeoutError, EOFError, OSError) as exc:
            broken = True  # stuck or dead: closed, so the next job starts a working one
            what = f"took longer than {self.timeout_s:g} s" if isinstance(exc, TimeoutError) else "failed"
            raise TokenizerUnavailable(f"{job} {what}") from None
        finally:
            self._give_back(child, broken)

    def close(self) -> None:
        """End every child: the idle ones closed now, the busy ones killed (each waiting job then
        reads EOF, ends with TokenizerUnavailable and closes its child); starts under way close
        theirs when they finish."""
        with self._changed:
            self._closed = True
            idle, busy = self._idle, list(self._busy)
            self._idle = []
            self._running.difference_update(idle)
            self._changed.notify_all()
        for child in busy:
            child.kill()
        for child in idle:
            child.close()


class TokenizerProcesses(ChildProcesses):
    """Children that tokenize long texts (a tokenizer's JSON each)."""

    def __init__(self, tokenizer_json: str, processes: int, timeout_s: float):
        super().__init__(_TOKENIZER + tokenizer_json.encode(), processes, timeout_s)

    def encode(self, text: str, add_special_tokens: bool, limit: int | None = None) -> list[int] | int:
        """The ids of `text`, or their count when it exceeds `limit`."""
        answer = self._request(_REQUEST.pack(add_special_tokens, -1 if limit is None else limit) + text.encode(),
                               "tokenizing the text")
        (count,) = _COUNT.unpack_from(answer)
        if len(answer) == _COUNT.size and count:
            return count
        return array.array("i", answer[_COUNT.size:]).tolist()


class TemplateFailed(Exception):
    """The chat template failed or went over a limit (`limit`: the RenderLimits field, or None)."""

    def __init__(self, message: str, limit: str | None):
        super().__init__(message)
        self.limit = limit


class TemplateProcesses(ChildProcesses):
    """Children that render chat templates under `limits` (a dict of RenderLimits' fields: this
    module imports no Tessera code)."""

    kind, serves = "chat template", "the render limits"

    def __init__(self, limits: dict[str, float], processes: int):
        timeout_s = float(limits["timeout_s"]) + RENDER_GRACE_S
        super().__init__(_TEMPLATE + json.dumps(limits).encode(), processes, timeout_s, max(timeout_s, TEMPLATE_START_S))
        self.limits = limits

    def render(self, template: str, special: dict[str, str], messages: list[dict], add_generation_prompt: bool,
               variables: dict) -> str:
        """The rendered text; TemplateFailed for the template's own failure or a limit (a child
        killed past the time limit, or one that died rendering, included: only the template can
        cause either), and TokenizerUnavailable when no child could take the job."""
        message = json.dumps({"template": template, "special": special, "messages": messages,
                              "add_generation_prompt": add_generation_prompt, "variables": variables}).encode()
        job = "rendering the chat template"
        try:
            answer = self._request(message, job)
        except TokenizerUnavailable as exc:
            if not str(exc).startswith(job):
                raise
            if "took longer than" in str(exc):
                raise TemplateFailed(f"the chat template took longer than {self.limits['timeout_s']:g} s to render",
                                     "timeout_s") from None
            raise TemplateFailed("the chat template's render process died (it may have gone over the memory "
                                 "limit)", "max_memory_mb") from None
        if answer[:1] == b"\0":
            return answer[1:].decode("utf-8", "surrogatepass")
        error = json.loads(answer[1:])
        raise TemplateFailed(error["message"], error["limit"])


if __name__ == "__main__":
    _serve(Connection(int(sys.argv[1])))
