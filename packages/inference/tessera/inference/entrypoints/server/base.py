"""Shared request plumbing of the HTTP handlers (server/app.py composes them)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from tessera.common.chat_template import ChatTemplateError, template_source
from tessera.inference.core.sampling_params import SamplingParams
from tessera.inference.core.structured_spec import StructuredSpec
from tessera.inference.engine.frontend import (
    ChoiceGroup,
    EngineDead,
    EngineFrontend,
    RequestFailed,
    RequestHandle,
)
from tessera.inference.engine.llm_engine import RequestOutput, RequestRejected
from tessera.inference.engine.metrics import ServingMetrics
from tessera.inference.entrypoints.grammar_check import GrammarCheck, GrammarCheckUnavailable
from tessera.inference.entrypoints.protocol import FieldError
from tessera.inference.entrypoints.server.errors import ApiError, ServerLimits, _check_text, error_body
from tessera.inference.entrypoints.server.guard import RAW_SEND
from tessera.inference.entrypoints.server.images import VisionFacts
from tessera.inference.entrypoints.tokenizer_process import (
    LONG_TEXT_CHARS,
    TemplateFailed,
    TemplateProcesses,
    TokenizerProcesses,
    TokenizerUnavailable,
)

DISCONNECT_POLL_S = 0.5
# json.dumps(obj, ensure_ascii=False) builds a JSONEncoder per call (any non-default argument does):
# one made once writes the same text in a third of the time.
_encode = json.JSONEncoder(ensure_ascii=False).encode
_string = json.encoder.encode_basestring  # a str as JSON, exactly as _encode writes it inside an object
# tessera-serve's flag for each RenderLimits field, named in a refusal.
TEMPLATE_LIMIT_FLAGS = {"timeout_s": "--chat-template-timeout", "max_iterations": "--chat-template-max-iterations",
                        "max_chars": "--chat-template-max-chars", "max_memory_mb": "--chat-template-max-memory"}



def coalesced(ready: list[tuple[int, Any]]) -> list[tuple[int, Any]]:
    """The (index, output or failure) items a consumer found queued, with each request's outputs
    merged (RequestOutput.merge) up to any failure or sentinel, which keep their place. At 64 streams
    an SSE chunk costs the HTTP process about as much CPU as a whole engine step's host work per token
    (benchmarks/RESULTS.md): a consumer that fell behind sends one chunk per request, not one per step."""
    out: list[tuple[int, Any]] = []
    open_at: dict[int, int] = {}  # index -> position in out of its unfinished, mergeable output
    for i, item in ready:
        at = open_at.get(i)
        if isinstance(item, RequestOutput) and at is not None:
            out[at] = (i, out[at][1].merge(item))
            if item.finished:
                del open_at[i]
            continue
        if isinstance(item, RequestOutput):
            if not item.finished:
                open_at[i] = len(out)
        else:
            open_at.clear()  # nothing later moves before a failure or the end
        out.append((i, item))
    return out

class SseResponse(StreamingResponse):
    """An SSE reply from an async iterator of str events, each written as it comes. An error after
    the headers went out (the status cannot change any more) is sent as an error event and [DONE].
    starlette's own loop, less a generator layer and a type check per event: it runs per token."""

    media_type = "text/event-stream"
    _raw_send = None

    async def __call__(self, scope, receive, send) -> None:
        self._raw_send = scope.get(RAW_SEND)
        await super().__call__(scope, receive, send)

    async def stream_response(self, send) -> None:
        # The start and the end go through the middleware's wrappers, which only watch for the
        # start (to know whether an error may still become a 500); the events in between go
        # straight to the server: two coroutine layers less per streamed token.
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        events = self._raw_send or send
        try:
            async for event in self.body_iterator:
                await events({"type": "http.response.body", "body": event.encode(), "more_body": True})
        except (EngineDead, RequestFailed, RequestRejected) as exc:
            client = isinstance(exc, RequestRejected) or (isinstance(exc, RequestFailed) and exc.client)
            event = ServerBase._sse(error_body(str(exc), "invalid_request_error" if client else "server_error"))
            for tail in (event, "data: [DONE]\n\n"):
                await events({"type": "http.response.body", "body": tail.encode(), "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


class StreamChunks:
    """The SSE events of one stream, as `ServerBase._sse` writes them, byte for byte: the fields that
    never change within a stream (id, object, created, model, a null usage) are encoded once, and
    the commonest choices (new text, nothing else) are written without building a dict. At 64
    streams the HTTP process's CPU per token is the decode step's bound (benchmarks/RESULTS.md)."""

    def __init__(self, rid: str, obj: str, created: int, model: str, usage: bool):
        head = _encode({"id": rid, "object": obj, "created": created, "model": model})
        self._head = f"data: {head[:-1]}, \"choices\": ["
        self._tail = "], \"usage\": null}\n\n" if usage else "]}\n\n"

    def event(self, choice: dict[str, Any]) -> str:
        """The event of a chunk with this one choice."""
        return f"{self._head}{_encode(choice)}{self._tail}"

    def text(self, index: int, text: str, finish_reason: str | None) -> str:
        """A completion chunk: {"index", "text", "logprobs": null, "finish_reason"}."""
        reason = "null" if finish_reason is None else _string(finish_reason)
        return (f'{self._head}{{"index": {index}, "text": {_string(text)}, "logprobs": null, '
                f'"finish_reason": {reason}}}{self._tail}')

    def content(self, index: int, content: str, finish_reason: str | None) -> str:
        """A chat chunk: {"index", "delta": {"content"}, "logprobs": null, "finish_reason"}."""
        reason = "null" if finish_reason is None else _string(finish_reason)
        return (f'{self._head}{{"index": {index}, "delta": {{"content": {_string(content)}}}, "logprobs": null, '
                f'"finish_reason": {reason}}}{self._tail}')


class ServerBase:
    """What the endpoint handlers share: the engine, limits, metrics, tokenizer threads, and
    request plumbing (tokenizing off the event loop, submitting, merging outputs, SSE)."""

    def __init__(self, engine: EngineFrontend, model_name: str, limits: ServerLimits, metrics: ServingMetrics):
        self.engine = engine
        self.model_name = model_name
        self.limits = limits
        self.metrics = metrics
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.generation_defaults = engine.generation_defaults  # the model's request defaults (--generation-config)
        self.vision = VisionFacts.from_wire(engine.vision)  # None: a text-only model (server/images.py)
        # How "auto" tool calls are read from generated text (tools.py): hermes, llama3_json, or
        # auto (from the chat template: hermes when it teaches <tool_call>).
        self.tool_call_parser = "auto"
        # Tokenizing a 4 MiB prompt takes seconds: it runs on these threads, never on the event
        # loop (/health and every open stream keep going meanwhile), and only after a length
        # check in characters that needs no tokenizer.
        self._tokenize_pool = ThreadPoolExecutor(limits.tokenizer_threads, thread_name_prefix="tessera-tokenize")
        # Long texts go on from those threads to child processes (tokenizer_process.py): the
        # tokenizers library still takes the GIL in parts of a long encode (converting the text
        # and the ids), time that /health and every open stream would wait for in this process.
        # None runs until the first long text needs one; the app's lifespan closes them at exit.
        self._tokenize_procs = TokenizerProcesses(self.tokenizer.backend.to_str(), limits.tokenizer_threads,
                                                  limits.tokenize_timeout_s)
        # Chat templates render in child processes of their own, bounded (RenderLimits; see
        # tokenizer_process.py), waited on from threads of their own: a runaway template holds
        # neither the event loop nor the tokenizer threads a completion needs.
        self._render_pool = ThreadPoolExecutor(limits.tokenizer_threads, thread_name_prefix="tessera-template")
        self._template_procs = TemplateProcesses(asdict(limits.chat_template), limits.tokenizer_threads)
        try:  # (source, special tokens), or why there is none
            self._template: tuple[str, dict[str, str]] | str = template_source(self.tokenizer)
        except ChatTemplateError as exc:
            self._template = str(exc)
        # Grammars are compiled first in child processes (grammar_check.py), on their own threads.
        self.grammar_check = GrammarCheck(self.tokenizer.backend.to_str(), engine.vocab_size, sorted(engine.eos_ids),
                                          limits.grammar)
        vocab = self.tokenizer.backend.get_vocab(with_added_tokens=True)
        # A token spells at most this many characters of text (byte-level BPE: bytes; a
        # normalizer may fold a few characters into one, hence the factor 2 below).
        self.max_prompt_chars = limits.max_prompt_tokens * max(map(len, vocab), default=1) * 2

    # ---- shared helpers --------------------------------------------------------------------
    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ApiError(404, f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found", type_="NotFoundError")

    def _generation_problem(self) -> str | None:
        """Why this server generates no text (an encoder serves /v1/embeddings only), or None."""
        if self.engine.generates:
            return None
        return (f"model {self.model_name!r} is an encoder: it generates no text; it serves /v1/embeddings, /v1/score and /v1/rerank only")

    def _check_generates(self) -> None:
        problem = self._generation_problem()
        if problem:
            raise ApiError(400, problem, param="model", code="generation_unsupported")

    async def _off_loop(self, fn, *args):
        """Run a tokenizer/template call on the tokenizer threads; its ApiError comes back here."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenize_pool, fn, *args)

    async def _render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                           variables: dict[str, Any]) -> str:
        """The chat template rendered with these messages: a failed or over-limit render is a 400
        naming the limit and its flag; no render process free in time, a 503."""
        return await asyncio.get_running_loop().run_in_executor(
            self._render_pool, self._render, messages, add_generation_prompt, variables)

    def _render(self, messages: list[dict[str, Any]], add_generation_prompt: bool, variables: dict[str, Any]) -> str:
        if isinstance(self._template, str):
            raise ApiError(400, self._template, param="messages")
        try:
            return self._template_procs.render(*self._template, messages, add_generation_prompt, variables)
        except TemplateFailed as exc:
            flag = TEMPLATE_LIMIT_FLAGS.get(exc.limit or "")
            raise ApiError(400, f"{exc} (limit: {flag})" if flag else str(exc), param="messages",
                           code="chat_template_limit" if flag else None) from None
        except TokenizerUnavailable as exc:
            raise ApiError(503, f"{exc}; try again later", code="tokenizer_busy", type_="server_error") from None
        except (ValueError, RecursionError):  # what json cannot write (nesting past its recursion limit)
            raise ApiError(400, "messages or chat_template_kwargs are nested too deeply", param="messages") from None

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """Token ids of `text`; a text too long to be a prompt is refused (400) here. On a tokenizer
        thread; a long text is tokenized in a child process while the thread waits."""
        if len(text) >= LONG_TEXT_CHARS:
            try:
                out = self._tokenize_procs.encode(text, add_special_tokens, self.limits.max_prompt_tokens)
            except TokenizerUnavailable as exc:
                raise ApiError(503, f"{exc}; try again later", code="tokenizer_busy", type_="server_error") from None
            if isinstance(out, int):  # more ids than any prompt may have: only their count came back
                self._check_prompt_length(out)
            return out  # type: ignore[return-value]
        # encode_batch, not encode: the tokenizers library's single encode holds the GIL for its
        # whole run (a 1 MB prompt: 1.7-4 s with no other thread running), encode_batch lets go.
        return self.tokenizer.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def _check_chars(self, text: str, what: str) -> None:
        """Refuse text that cannot fit --max-prompt-tokens before spending time tokenizing it."""
        if len(text) > self.max_prompt_chars:
            raise ApiError(400, f"{what} has {len(text)} characters, more than a prompt of at most "
                           f"{self.limits.max_prompt_tokens} tokens can hold", param=what.split()[0],
                           code="prompt_too_long")

    def _encode_prompt(self, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
        """Token ids of one prompt, length-checked; on a tokenizer thread (see _off_loop)."""
        if isinstance(prompt, str):
            self._check_chars(prompt, "prompt")
            _check_text(prompt, "prompt")
            # With the tokenizer's post-processor (BOS for Llama tokenizers), as vLLM and HF do.
            ids = self._encode(prompt, add_special_tokens=add_special_tokens)
        else:
            ids = list(prompt)
        self._check_prompt(ids)
        return ids

    def _check_prompt(self, ids: list[int]) -> None:
        self._check_prompt_length(len(ids))

    def _check_prompt_length(self, n: int) -> None:
        if n > self.limits.max_prompt_tokens:
            raise ApiError(400, f"prompt has {n} tokens; this server accepts at most "
                           f"{self.limits.max_prompt_tokens}", param="prompt", code="prompt_too_long")

    def _resolve_max_tokens(self, requested: int | None, prompt_len: int, allow_zero: bool = False) -> int:
        """A request's max_tokens: its own (checked), else the model's default (generation_config's
        max_new_tokens), else the room left in the context; capped as vLLM caps it
        (--override-generation-config's max_new_tokens: core/generation_defaults.py)."""
        cap = self.generation_defaults.max_tokens_cap
        if requested is None:
            room = min(self.limits.max_tokens, self.max_model_len - prompt_len)
            default = self.generation_defaults.values.get("max_tokens")
            return max(1, min([room, *(v for v in (default, cap) if v is not None)]))
        if cap is not None:
            requested = min(requested, cap)
        if requested > self.limits.max_tokens:
            raise ApiError(400, f"max_tokens {requested} exceeds this server's limit of {self.limits.max_tokens}",
                           param="max_tokens")
        if requested < (0 if allow_zero else 1):
            raise ApiError(400, "max_tokens must be at least 0" if allow_zero else
                           "max_tokens must be at least 1 (0, to score the prompt only, needs echo)", param="max_tokens")
        return requested

    def _token_text(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special_tokens=False)

    def _submit_all(self, prefix: str, jobs: list[tuple[list[int], SamplingParams]],
                    n: int = 1) -> tuple[list[RequestHandle], asyncio.Queue]:
        """Submit every job with one shared output queue (tagged by job index); each n consecutive
        jobs are the choices of one prompt (one group in the metrics)."""
        queue: asyncio.Queue = asyncio.Queue()
        handles: list[RequestHandle] = []
        groups = [ChoiceGroup(n) for _ in range(len(jobs) // n)]
        try:
            for i, (ids, params) in enumerate(jobs):
                handles.append(self.engine.submit(self.engine.next_request_id(prefix), ids, params, queue=queue, tag=i,
                                                  group=groups[i // n]))
        except BaseException:
            for h in handles:
                h.close()
            raise
        return handles, queue

    async def _collect(self, submitted: tuple[list[RequestHandle], asyncio.Queue], request: Request,
                       n: int) -> tuple[list[str], list[list[Any]], list[RequestOutput]] | None:
        """Run n requests to the end for a non-streamed reply: (texts, logprobs, final outputs,
        each carrying its request's prompt logprobs), or None when the client went away first."""
        texts = [""] * n
        lps: list[list[Any]] = [[] for _ in range(n)]
        final: list[RequestOutput | None] = [None] * n
        prompt_lps: list[Any] = [None] * n
        async for i, out in self._merged(submitted, request):
            texts[i] += out.new_text
            lps[i].extend(out.new_logprobs)
            if out.prompt_logprobs is not None:
                prompt_lps[i] = out.prompt_logprobs
            if out.finished:
                final[i] = out
        if any(f is None for f in final):
            return None
        for f, p in zip(final, prompt_lps):
            f.prompt_logprobs = p  # type: ignore[union-attr]  # the final output carries them all
        return texts, lps, final  # type: ignore[return-value]

    async def _merged(self, submitted: tuple[list[RequestHandle], asyncio.Queue], request: Request,
                      watch: bool = True) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Outputs of several requests as they come, as (index, output); stops (and aborts all)
        when the client disconnects or the consumer stops iterating. `watch`: poll for the
        disconnect here; an SSE reply (SseResponse) needs no poll: starlette listens for it and
        cancels the stream, which aborts its requests here as well."""
        handles, queue = submitted
        gone = object()

        async def poll() -> None:
            # Polls for a client disconnect so a request still queued (no output to send yet)
            # is cancelled too.
            while not await request.is_disconnected():
                await asyncio.sleep(DISCONNECT_POLL_S)
            queue.put_nowait((-1, gone))

        watcher = asyncio.create_task(poll()) if watch else None
        remaining = len(handles)
        try:
            while remaining:
                ready = [await queue.get()]
                if not queue.empty():  # behind the engine: take every queued output at once, merged
                    while not queue.empty():
                        ready.append(queue.get_nowait())
                    ready = coalesced(ready)
                for i, item in ready:
                    if item is gone:
                        return
                    if isinstance(item, RequestFailed):
                        raise item
                    if isinstance(item, BaseException):
                        raise EngineDead(f"the engine failed: {item}") from item
                    if item.finished:
                        handles[i].finished = True
                        remaining -= 1
                    yield i, item
        finally:
            if watcher is not None:
                watcher.cancel()
            for h in handles:
                h.close()

    @staticmethod
    def _sse(obj: Any) -> str:
        return f"data: {_encode(obj)}\n\n"

    async def _structured_spec(self, body: Any) -> StructuredSpec | None:
        """The request's structured-output constraint, checked (a bad or too costly schema, regex
        or grammar is a 400 naming its field), or None."""
        try:
            found = body.structured_spec()
        except FieldError as exc:
            raise ApiError(400, str(exc), param=exc.param) from None
        if found is None:
            return None
        spec, field = found
        await self._check_grammar(spec, field, f"{field}: ")
        return spec

    async def _check_grammar(self, spec: StructuredSpec, field: str, prefix: str) -> None:
        """400 naming `field` when the engine cannot take this constraint (grammar_check.py);
        503 when no grammar check process could be started."""
        try:
            problem = await self.grammar_check.problem(spec)
        except GrammarCheckUnavailable as exc:
            raise ApiError(503, f"{exc}; try again later", code="grammar_check_unavailable",
                           type_="server_error") from None
        if problem:
            raise ApiError(400, prefix + problem, param=field)

    def _check_supported(self, body: Any) -> None:
        field = body.unsupported_field()
        if field is not None:
            raise ApiError(400, f"{field} is not supported by this server; leave it out", param=field)
