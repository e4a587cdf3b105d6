"""The grammar check: a structured-output grammar the server has not seen is compiled, and its
first masks computed, in a child process with a memory and time budget, before the engine
compiles it in its own process.

Why a process: a grammar can crash llguidance outright (a stack overflow is a segfault, no
exception), allocate gigabytes, or run for minutes, and the engine compiles grammars in the engine
process (or, with --no-engine-process, in the HTTP process): there, one request would take every
other down. The static bounds (structured_limits.py) refuse the shapes known to do that; this
check is for whatever else a client finds. The child runs the engine's own steps, with the same
llguidance ParserLimits: LLMatcher over the same tokenizer, the first mask, then for up to PROBES
tokens that mask allows, spread across it, the token consumed and the next mask computed (in a
copy): llguidance reports some limits only there (over 2,000 choices, a 1 MB regex literal, or
`(a{1000}){1000}` compile and give a first mask, then fail at the first token). It runs on a thread
with a 2 MiB stack, a quarter of the 8 MiB the engine compiles on, so a grammar that passes here
has room to spare there. A child that dies (a crash, or past its memory budget: RLIMIT_AS, over
what it held after loading the tokenizer) or outlasts its time is a 400 naming the limit, and is
replaced by the next check that needs one.

Verdicts are cached per constraint (SHA-256 of its kind and value): a request with a schema seen
before pays a hash and a lookup. Timeouts and failures to start are not cached (the machine may
just have been busy).

Children: at most PROCESSES, each owned by one thread of the check pool (never shared, so no
locking around one), started when that thread first needs one and killed when the server closes.
They are tokenizer_process's `_Child` with another program: bytes over a socket pair (UTF-8
grammar in, UTF-8 verdict out), never pickle. Not its ChildProcesses pool: a check reads a dead
child's exit status (a crash and an exhausted memory budget are different 400s), and a child's
start (loading the tokenizer) has a timeout of its own, longer than a check's. This module imports only the standard library at
the top (and llguidance in the child), so a child starts in a fraction of a second.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import signal
import sys
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from tessera.inference.entrypoints.tokenizer_process import _Child

if TYPE_CHECKING:
    from tessera.inference.core.structured_limits import GrammarLimits
    from tessera.inference.core.structured_spec import StructuredSpec

PROCESSES = 2
PROBES = 4
CHECK_STACK_BYTES = 2 * 2**20
START_TIMEOUT_S = 30.0
CACHED_VERDICTS = 1024
_OUT_OF_MEMORY = "\x00memory"  # the child's answer when Python itself ran out of its budget
_EXCERPT = re.compile(r"\d+ \|.*|[\s^~]+")  # "   1 | start: /a(/" and the "^" line under it


class GrammarCheckUnavailable(Exception):
    """No grammar check process could be started (a 503: the server's fault, not the grammar's)."""


# ---- the child ---------------------------------------------------------------------------------
def _allowed(mask: bytes) -> list[int]:
    """Token ids whose bit is set in llguidance's bitmask (little-endian 32-bit words)."""
    return [8 * i + j for i, byte in enumerate(mask) if byte for j in range(8) if byte >> j & 1]


def _check(llmatcher: Any, tokenizer: Any, limits: Any, grammar: str) -> str:
    """Why the engine could not run this grammar (llguidance's message), or ""."""
    matcher = llmatcher(tokenizer, grammar, log_level=0, limits=limits)
    if matcher.is_error():
        return matcher.get_error()
    allowed = _allowed(matcher.compute_bitmask())
    if matcher.is_error():
        return matcher.get_error()
    if not allowed:
        return "no token of this model's vocabulary can start an output that matches it"
    step = max(1, (len(allowed) - 1) // max(1, PROBES - 1))
    for token in allowed[::step][:PROBES]:
        probe = matcher.deep_copy()
        if not probe.consume_token(token):
            return probe.get_error() or f"token {token}, allowed by the first mask, was refused"
        probe.compute_bitmask()
        if probe.is_error():
            return probe.get_error()
    return ""


def _message(answer: str) -> str | None:
    """llguidance's message on one line, without the source excerpt it draws under it."""
    lines = [line.strip() for line in answer.splitlines()]
    kept = [line.replace("<non-verbose/>", "").strip() for line in lines if line and not _EXCERPT.fullmatch(line)]
    return " ".join(kept)[:1000] or None


def _limit_memory(budget: int) -> None:
    """RLIMIT_AS = the address space held now + budget (Linux; elsewhere no budget)."""
    try:
        import resource

        with open("/proc/self/statm") as f:
            size = int(f.read().split()[0]) * resource.getpagesize()
    except (ImportError, OSError):
        return
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    soft = size + budget if hard == resource.RLIM_INFINITY else min(size + budget, hard)
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def _serve(conn: Connection) -> None:
    """The child's loop: the set-up first (tokenizer, limits, memory budget; answered with an empty
    ready message), then one verdict per grammar."""
    from llguidance import LLMatcher, LLParserLimits, LLTokenizer

    init = json.loads(conn.recv_bytes())
    tokenizer = LLTokenizer(init["tokenizer"], n_vocab=init["vocab_size"], eos_token=init["eos_ids"] or None)
    limits = LLParserLimits(**init["parser_limits"])
    _check(LLMatcher, tokenizer, limits, LLMatcher.grammar_from_regex("[a-z]+"))  # allocator arena, before the budget
    _limit_memory(init["memory_bytes"])
    conn.send_bytes(b"")
    while True:
        try:
            grammar = conn.recv_bytes().decode("utf-8", "surrogatepass")
        except (EOFError, OSError):  # the server went away
            return
        try:
            answer = _check(LLMatcher, tokenizer, limits, grammar)
        except MemoryError:
            answer = _OUT_OF_MEMORY
        except Exception as exc:  # a panic inside llguidance, surfaced by its bindings
            answer = f"the grammar engine failed on it: {exc}"
        conn.send_bytes(answer.encode("utf-8", "surrogatepass"))


def _main(fd: int) -> None:
    threading.stack_size(CHECK_STACK_BYTES)
    worker = threading.Thread(target=_serve, args=(Connection(fd),), name="tessera-grammar-check")
    worker.start()
    worker.join()


# ---- the server side ---------------------------------------------------------------------------
class _CheckChild(_Child):
    command = [sys.executable, "-m", __name__]


class GrammarCheck:
    """The server's grammar check: static bounds, then a child process; verdicts cached."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: list[int], limits: GrammarLimits,
                 processes: int = PROCESSES):
        from tessera.inference.core.structured_limits import PARSER_LIMITS

        self.limits = limits
        self._init = json.dumps({"tokenizer": tokenizer_json, "vocab_size": vocab_size, "eos_ids": sorted(eos_ids),
                                 "parser_limits": PARSER_LIMITS, "memory_bytes": limits.check_memory_bytes}).encode()
        self._pool = ThreadPoolExecutor(processes, thread_name_prefix="tessera-grammar-check")
        self._local = threading.local()  # .child: this pool thread's child process
        self._lock = threading.Lock()  # guards everything below
        self._children: set[_CheckChild] = set()
        self._closed = False
        self._verdicts: OrderedDict[bytes, str | None] = OrderedDict()

    @property
    def num_processes(self) -> int:
        with self._lock:
            return len(self._children)

    async def problem(self, spec: StructuredSpec) -> str | None:
        """Why the engine cannot take this constraint (a 400 for it), or None. Raises
        GrammarCheckUnavailable when no check process could be started."""
        loop = asyncio.get_running_loop()
        key, verdict = await loop.run_in_executor(None, self._cached, spec)  # hashing a big schema: off the loop
        if key is None:
            return verdict
        verdict, keep = await loop.run_in_executor(self._pool, self._verdict, spec)
        if keep:
            with self._lock:
                self._verdicts[key] = verdict
                if len(self._verdicts) > CACHED_VERDICTS:
                    self._verdicts.popitem(last=False)
        return verdict

    def _cached(self, spec: StructuredSpec) -> tuple[bytes | None, str | None]:
        """(None, the verdict) when known, else (its cache key, None)."""
        key = hashlib.sha256(json.dumps([spec.kind, spec.value], ensure_ascii=True).encode()).digest()
        with self._lock:
            if key in self._verdicts:
                self._verdicts.move_to_end(key)
                return None, self._verdicts[key]
        return key, None

    def _verdict(self, spec: StructuredSpec) -> tuple[str | None, bool]:
        """(why not, or None; whether to cache it), on a pool thread."""
        from tessera.inference.core.structured_spec import prepare

        try:
            grammar = prepare(spec, self.limits)
        except ValueError as exc:
            return str(exc), True
        child = getattr(self._local, "child", None) or self._start()
        timeout = self.limits.check_timeout_s
        try:
            answer = child.request(grammar.encode("utf-8", "surrogatepass"), timeout).decode("utf-8", "surrogatepass")
        except TimeoutError:
            self._drop(child)
            return f"compiling it took longer than this server's limit of {timeout:g} s (--grammar-check-timeout)", False
        except (EOFError, OSError):
            code = self._drop(child, wait=True)
            if self._closed:  # killed by close(), not by the grammar
                raise GrammarCheckUnavailable("the server is shutting down") from None
            return (self._out_of_memory() if code == -signal.SIGABRT else self._crashed(code)), True
        if answer == _OUT_OF_MEMORY:
            self._drop(child)
            return self._out_of_memory(), True
        return _message(answer), True

    def _out_of_memory(self) -> str:
        # Rust's allocation failure handler aborts the process (SIGABRT); Python raises MemoryError.
        return (f"compiling it needed more memory than this server's limit of {self.limits.check_memory_bytes} "
                "bytes (--grammar-check-memory)")

    @staticmethod
    def _crashed(code: int | None) -> str:
        try:
            how = signal.Signals(-code).name if code is not None and code < 0 else f"exit code {code}"
        except ValueError:
            how = f"signal {-code}"  # type: ignore[operator]
        return (f"compiling it crashed the grammar engine ({how}; most likely a stack overflow: too many rules or "
                "references nested in one another)")

    def _start(self) -> _CheckChild:
        with self._lock:
            if self._closed:
                raise GrammarCheckUnavailable("the server is shutting down")
        try:
            child = _CheckChild(self._init, START_TIMEOUT_S)
        except (OSError, EOFError, TimeoutError) as exc:
            raise GrammarCheckUnavailable(f"could not start a grammar check process ({type(exc).__name__})") from None
        with self._lock:
            if not self._closed:
                self._children.add(child)
                self._local.child = child
                return child
        child.close()
        raise GrammarCheckUnavailable("the server is shutting down")

    def _drop(self, child: _CheckChild, wait: bool = False) -> int | None:
        """Close this thread's child (it is stuck or dead); its exit code (negative: a signal)."""
        self._local.child = None
        with self._lock:
            self._children.discard(child)
        if wait:
            try:
                child.process.wait(timeout=2)  # it is exiting: read why before close() kills it
            except Exception:
                pass
        child.close()
        return child.process.returncode

    def close(self) -> None:
        """Kill every child (a check in progress then ends as a dead child) and stop the pool."""
        with self._lock:
            self._closed = True
            children, self._children = list(self._children), set()
        for child in children:
            child.kill()
        self._pool.shutdown(wait=False, cancel_futures=True)


if __name__ == "__main__":
    _main(int(sys.argv[1]))
