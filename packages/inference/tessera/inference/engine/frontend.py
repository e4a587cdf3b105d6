"""The engine behind the HTTP server, seen from the asyncio event loop: submit a request, read
its outputs from an asyncio queue, abort it when the consumer goes away.

`EngineFrontend` is the part every backend shares: per-request streams, request ids, the queue
limit, metrics and delivery to the event loop (one `call_soon_threadsafe` per engine step).
Two backends step the engine:
  - `AsyncEngine` (here): a background thread in the server process (tests, `--no-engine-process`);
  - `process_client.ProcessEngine`: the engine in its own process (tessera-serve's default), so
    the model never shares a GIL with the HTTP layer.
A request whose consumer goes away (client disconnect, cancelled task) is aborted and its
blocks freed at the start of the next step.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from tessera.inference.core.generation_defaults import GenerationDefaults
from tessera.inference.core.image_inputs import check_image_spans
from tessera.inference.core.sampling_params import SamplingParams
from tessera.inference.engine.llm_engine import LLMEngine, RequestOutput, RequestRejected, validate_request
from tessera.inference.engine.loop import run_engine_loop
from tessera.inference.engine.metrics import ServingMetrics
from tessera.inference.worker.pooling.spec import PoolingSpec

log = logging.getLogger("tessera.inference")


class QueueFull(Exception):
    """More requests are waiting than the server accepts (HTTP 429)."""


class EngineDead(Exception):
    """The engine failed or stopped; the request cannot complete (HTTP 500)."""


class RequestFailed(Exception):
    """Computing this one request failed inside the engine (HTTP 500 for it, or 400 when `client`:
    its own grammar outgrew a limit); the engine and every other request go on."""

    def __init__(self, message: str, client: bool = False):
        super().__init__(message)
        self.client = client


class ChoiceGroup:
    """The n requests of one prompt (vLLM's sequence group): when the last of them ends, the most
    tokens one of them generated is observed once (vllm:request_max_num_generation_tokens)."""

    def __init__(self, size: int):
        self.open = size
        self.max_generated = 0
        self.finished = False  # some member ended with its output (not aborted or failed)


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue  # receives (tag, RequestOutput | exception)
    tag: int = 0
    group: ChoiceGroup = field(default_factory=lambda: ChoiceGroup(1))
    arrival: float = field(default_factory=time.monotonic)
    first_token: float | None = None
    last_token: float | None = None


class RequestHandle:
    """The consumer side of one request: read its outputs; close() aborts it if unfinished."""

    def __init__(self, engine: EngineFrontend, request_id: str, queue: asyncio.Queue):
        self.engine = engine
        self.request_id = request_id
        self.queue = queue
        self.finished = False

    async def get(self, timeout: float | None = None) -> RequestOutput:
        """Next output; raises TimeoutError after `timeout` s without one, EngineDead on failure."""
        _, item = await asyncio.wait_for(self.queue.get(), timeout) if timeout else await self.queue.get()
        if isinstance(item, RequestFailed):
            self.finished = True
            raise item
        if isinstance(item, BaseException):
            self.finished = True
            raise EngineDead(f"the engine failed: {item}") from item
        if item.finished:
            self.finished = True
        return item

    def close(self) -> None:
        if not self.finished:
            self.finished = True
            self.engine.abort(self.request_id)


class EngineFrontend:
    """Streams, ids, limits and metrics; a backend implements `_send_add`, `_send_abort`
    (called without the lock: a send may block, and delivery must not wait on it),
    `_num_waiting` (called with the lock held), `healthy`, `start` and `shutdown`."""

    pooling: PoolingSpec | None = None  # the model's pooling (/v1/embeddings); None: it declares none
    generates: bool = True  # False: an encoder, served as embeddings only
    vision: dict | None = None  # a vision-language model's image facts (worker/multimodal/info.py); None: text only
    scores_prompts: bool = True  # False: prompt logprobs are refused (an encoder-decoder's prompt is its encoder input)
    generation_defaults: GenerationDefaults = GenerationDefaults()  # request defaults (--generation-config)

    def __init__(self, tokenizer, max_model_len: int, vocab_size: int, eos_ids, max_waiting: int,
                 metrics: ServingMetrics | None = None):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.eos_ids = frozenset(eos_ids)
        self.max_waiting = max_waiting
        self.metrics = metrics
        self._cv = threading.Condition()
        self._streams: dict[str, _Stream] = {}
        self._counter = 0
        # Set when several HTTP processes share one engine (api_servers.py): each its own tag, so
        # their request ids never meet in the engine.
        self.request_id_tag: str | None = None

    # ---- backend hooks ---------------------------------------------------------------------
    def _send_add(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        raise NotImplementedError

    def _send_abort(self, request_id: str) -> None:
        raise NotImplementedError

    def _num_waiting(self) -> int:
        raise NotImplementedError

    @property
    def healthy(self) -> bool:
        raise NotImplementedError

    # ---- shared ----------------------------------------------------------------------------
    def num_active(self) -> int:
        with self._cv:
            return len(self._streams)

    def next_request_id(self, prefix: str) -> str:
        with self._cv:
            self._counter += 1
            if self.request_id_tag is not None:
                return f"{prefix}-{self.request_id_tag}-{self._counter}"
            return f"{prefix}-{self._counter}"

    def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
               queue: asyncio.Queue | None = None, tag: int = 0, group: ChoiceGroup | None = None) -> RequestHandle:
        """Queue a request (validated here, so errors reach the caller); call from the event loop.

        Outputs arrive as (tag, output) on `queue` (a new one by default): several requests can
        share one queue, which is how a multi-prompt HTTP request reads all its choices. The
        choices of one prompt share a `group` (default: a group of one).
        """
        if not self.healthy:
            raise EngineDead("the engine has stopped")
        validate_request(prompt_ids, params, self.vocab_size, self.max_model_len, self.eos_ids, self.scores_prompts)
        if problem := check_image_spans(params.images, prompt_ids, (self.vision or {}).get("image_token_id")):
            raise RequestRejected(problem, "messages" if params.images else "prompt")
        stream = _Stream(loop=asyncio.get_running_loop(), queue=queue or asyncio.Queue(), tag=tag,
                         group=group or ChoiceGroup(1))
        with self._cv:
            waiting = self._num_waiting()
            if waiting >= self.max_waiting:
                raise QueueFull(f"{waiting} requests are already waiting; retry later")
            self._streams[request_id] = stream
        try:
            self._send_add(request_id, prompt_ids, params)
        except BaseException:
            with self._cv:
                self._streams.pop(request_id, None)
            raise
        return RequestHandle(self, request_id, stream.queue)

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Submit and yield outputs until finished; leaving early (break, cancel) aborts."""
        handle = self.submit(request_id, prompt_ids, params)
        try:
            while True:
                out = await handle.get()
                yield out
                if out.finished:
                    return
        finally:
            handle.close()

    def abort(self, request_id: str) -> None:
        with self._cv:
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                self._ended(stream, None)
        if stream is not None:
            self._send_abort(request_id)

    def _deliver(self, items: list[tuple[str, RequestOutput | BaseException]], now: float | None = None) -> None:
        """Route one step's outputs (or failures) to their streams: one wake-up per event loop."""
        routed: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, tuple]]] = {}
        observe = self.metrics is not None and now is not None
        generated = 0
        with self._cv:
            for request_id, item in items:
                stream = self._streams.get(request_id)
                if stream is None:
                    continue  # aborted meanwhile
                if isinstance(item, RequestOutput) and item.error is not None:
                    item = RequestFailed(item.error, item.client_error)
                if observe and isinstance(item, RequestOutput):
                    generated += self._observe(stream, item, now)  # type: ignore[arg-type]
                if isinstance(item, BaseException) or item.finished:
                    del self._streams[request_id]
                    self._ended(stream, item if isinstance(item, RequestOutput) else None)
                routed.setdefault(stream.loop, []).append((stream.queue, (stream.tag, item)))
        if generated:
            self.metrics.child(self.metrics.generation_tokens).inc(generated)  # type: ignore[union-attr]
        for loop, puts in routed.items():
            try:
                loop.call_soon_threadsafe(_put_all, puts)
            except RuntimeError:
                pass  # that event loop has closed: nobody is listening any more

    def _fail_all(self, exc: BaseException) -> None:
        with self._cv:
            ids = list(self._streams)
        self._deliver([(rid, exc) for rid in ids])

    def _observe(self, stream: _Stream, out: RequestOutput, now: float) -> int:
        """Latency metrics of one output; returns its new tokens (counted once per step by the caller)."""
        m = self.metrics
        n = len(out.new_token_ids)
        if n:
            if stream.first_token is None:
                stream.first_token = now
                m.observe_token(True, now - stream.arrival)
            elif stream.last_token is not None:
                m.observe_token(False, now - stream.last_token)
            stream.last_token = now
        if out.finished:
            m.observe_finished(out, now - stream.arrival)
        return n


    def _ended(self, stream: _Stream, final: RequestOutput | None) -> None:
        """A request left (its final output, or None: aborted or failed); called with the lock held."""
        group = stream.group
        group.open -= 1
        if final is not None:
            group.finished = True
            group.max_generated = max(group.max_generated, final.num_output_tokens)
        if group.open == 0 and group.finished and self.metrics is not None:
            self.metrics.observe_group_finished(group.max_generated)


def _put_all(puts: list[tuple[asyncio.Queue, tuple]]) -> None:
    for queue, item in puts:
        queue.put_nowait(item)


class AsyncEngine(EngineFrontend):
    """The engine stepped by a background thread of the server process.

    Requests and aborts reach the thread through an inbox under the lock; the thread sleeps
    when there is nothing to do.
    """

    def __init__(self, engine: LLMEngine, metrics: ServingMetrics | None = None):
        super().__init__(engine.tokenizer, engine.max_model_len, engine.loaded.config.vocab_size, engine.eos_ids,
                         engine.cfg.max_waiting, metrics)
        self.engine = engine
        self.pooling = engine.pooling
        self.generates = engine.generates
        self.vision = engine.vision
        self.scores_prompts = engine.scores_prompts
        self.generation_defaults = engine.generation_defaults
        self._inbox: list[tuple] = []  # commands for the engine loop, in arrival order
        self._num_adds_queued = 0
        self._stop = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="tessera-engine", daemon=True)

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        # The engine thread drops the GIL inside every torch op and must win it back quickly:
        # at Python's default 5 ms switch interval a busy event loop holds it up to 5 ms each
        # time, hundreds of times per step (a GIL convoy). 0.01 ms keeps the model fed.
        sys.setswitchinterval(min(sys.getswitchinterval(), 1e-5))
        self._thread.start()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Let running requests finish (up to `timeout` s), then stop the thread, which closes the
        engine (its tensor-parallel workers: bounded, see executor.shutdown)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.num_active() and self._thread.is_alive():
            time.sleep(0.05)
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread.ident is None:  # never started: nothing else will close the engine
            self.engine.close()
            return
        self._thread.join(timeout=30.0)

    @property
    def healthy(self) -> bool:
        return self._error is None and self._thread.is_alive()

    # ---- backend hooks ---------------------------------------------------------------------
    def _send_add(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        with self._cv:
            self._inbox.append(("add", request_id, prompt_ids, params))
            self._num_adds_queued += 1
            self._cv.notify()

    def _send_abort(self, request_id: str) -> None:
        with self._cv:
            self._inbox.append(("abort", request_id))
            self._cv.notify()

    def _num_waiting(self) -> int:
        return self._num_adds_queued + len(self.engine.scheduler.waiting)

    # ---- the engine thread -----------------------------------------------------------------
    def _receive(self, block: bool) -> list[tuple]:
        with self._cv:
            while block and not (self._stop or self._inbox):
                self._cv.wait()
            if self._stop:
                return [("stop",)]
            commands, self._inbox = self._inbox, []
            self._num_adds_queued = 0
        return commands

    def _emit(self, outputs: list[RequestOutput], failed: list[tuple[str, str]], stats, num_adds: int) -> None:
        items: list[tuple[str, RequestOutput | BaseException]] = [(rid, EngineDead(msg)) for rid, msg in failed]
        self._deliver(items + [(out.request_id, out) for out in outputs], time.monotonic())
        if self.metrics is not None:
            self.metrics.update_engine(stats)

    def _run(self) -> None:
        try:
            run_engine_loop(self.engine, self._receive, self._emit)
        except BaseException as exc:  # a bug or an OOM: fail every request rather than hang them
            log.exception("engine thread failed")
            self._error = exc
            self._fail_all(exc)
        finally:
            # The engine is this thread's to close, as the engine process closes its own: whoever
            # stops the server (tessera-serve, a test's uvicorn) then leaves no tensor-parallel
            # worker running. The last thing the thread does, so no step is still using the workers.
            self.engine.close()
