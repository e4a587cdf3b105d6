"""The HTTP server: OpenAI-compatible completions and chat (with SSE streaming), Megatron's
PUT /api, model list, health and Prometheus metrics, over one engine frontend (async_engine.EngineFrontend).

Every error is returned in OpenAI's shape {"error": {"message", "type", "param", "code"}}
(Megatron's /api keeps its own: a JSON string and status 400). Leaving a request early — client
disconnect, cancelled stream — aborts it in the engine and frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from tessera.inference.async_engine import EngineDead, EngineFrontend, QueueFull, RequestFailed, RequestHandle
from tessera.inference.chat_template import ChatTemplateError, render_chat
from tessera.inference.engine import RequestOutput, RequestRejected
from tessera.inference.metrics import ServingMetrics
from tessera.inference.protocol import ChatCompletionRequest, CompletionRequest, MegatronRequest
from tessera.inference.sampling_params import SamplingParams
from tessera.inference.sequence import TokenLogprob

DISCONNECT_POLL_S = 0.5


@dataclass
class ServerLimits:
    max_prompt_tokens: int
    max_tokens: int
    max_prompts: int = 64
    max_body_bytes: int = 4 * 2**20
    drain_timeout_s: float = 30.0
    body_timeout_s: float = 30.0  # a request body must arrive within this (a stalled one is dropped)
    tokenizer_threads: int = 2  # prompts are tokenized and templates rendered here, off the event loop


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                   code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, type_, param, code), status_code=status, headers=headers)


def _validation_message(exc: ValidationError | RequestValidationError) -> tuple[str, str | None]:
    err = exc.errors()[0]
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    if err.get("type") == "json_invalid":
        return "request body is not valid JSON", None
    return (f"{param}: {err['msg']}" if param else err["msg"]), param


class _GuardMiddleware:
    """Pure ASGI, in front of every route: the API-key check on /v1 and /api, then the whole
    request body read here, bounded in size (400) and in time (408, connection closed: a client
    that stalls mid-body cannot hold a connection open), before any handler runs."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int, body_timeout_s: float):
        self.app, self.api_key, self.max_body, self.body_timeout = app, api_key, max_body_bytes, body_timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        headers = dict(scope.get("headers") or [])
        if self.api_key and (path.startswith("/v1") or path == "/api"):
            given = headers.get(b"authorization", b"").decode("latin-1")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
                resp = error_response(401, "missing or invalid API key; send 'Authorization: Bearer <key>'",
                                      "authentication_error", code="invalid_api_key")
                return await resp(scope, receive, send)
        too_big = error_response(400, f"request body exceeds {self.max_body} bytes", code="request_too_large",
                                 headers={"connection": "close"})
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            return await too_big(scope, receive, send)
        try:
            body, disconnected = await asyncio.wait_for(self._read_body(receive), self.body_timeout)
        except TimeoutError:
            slow = error_response(408, f"request body not received within {self.body_timeout:g} s",
                                  code="request_timeout", headers={"connection": "close"})
            return await slow(scope, receive, send)
        except _BodyTooLarge:
            return await too_big(scope, receive, send)
        if disconnected:
            return None
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: only http.disconnect comes

        return await self.app(scope, replay, send)

    async def _read_body(self, receive) -> tuple[bytes, bool]:
        chunks: list[bytes] = []
        seen = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return b"", True
            chunk = message.get("body", b"")
            seen += len(chunk)
            if seen > self.max_body:
                raise _BodyTooLarge
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks), False


class _BodyTooLarge(Exception):
    pass


def _check_text(text: str, what: str) -> None:
    """JSON can carry a lone surrogate escape (\\udc80) that is no Unicode text; the tokenizer cannot take it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ApiError(400, f"{what} is not valid Unicode: lone surrogate {text[exc.start]!r} at character "
                       f"{exc.start}; send UTF-8 text", param=what.split()[0]) from None


def _now() -> int:
    return int(time.time())


class OpenAIServer:
    """Builds the FastAPI app; holds what the handlers share (no module-level state)."""

    def __init__(self, engine: EngineFrontend, model_name: str, limits: ServerLimits, metrics: ServingMetrics):
        self.engine = engine
        self.model_name = model_name
        self.limits = limits
        self.metrics = metrics
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        # Tokenizing a 4 MiB prompt takes seconds: it runs on these threads, never on the event
        # loop (/health and every open stream keep going meanwhile), and only after a length
        # check in characters that needs no tokenizer.
        self._tokenize_pool = ThreadPoolExecutor(limits.tokenizer_threads, thread_name_prefix="tessera-tokenize")
        vocab = self.tokenizer.backend.get_vocab(with_added_tokens=True)
        # A token spells at most this many characters of text (byte-level BPE: bytes; a
        # normalizer may fold a few characters into one, hence the factor 2 below).
        self.max_prompt_chars = limits.max_prompt_tokens * max(map(len, vocab), default=1) * 2

    # ---- shared helpers --------------------------------------------------------------------
    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ApiError(404, f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found", type_="NotFoundError")

    async def _off_loop(self, fn, *args):
        """Run a tokenizer/template call on the tokenizer threads; its ApiError comes back here."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenize_pool, fn, *args)

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        # encode_batch, not encode: the tokenizers library's single encode holds the GIL for its
        # whole run (a 1 MB prompt: 1.7-4 s with no other thread running), encode_batch lets go.
        return self.tokenizer.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def _check_chars(self, text: str, what: str) -> None:
        """Refuse text that cannot fit --max-prompt-tokens before spending time tokenizing it."""
        if len(text) > self.max_prompt_chars:
            raise ApiError(400, f"{what} has {len(text)} characters, more than a prompt of at most "
                           f"{self.limits.max_prompt_tokens} tokens can hold", param=what.split()[0],
                           code="prompt_too_long")

    def _encode_prompt(self, prompt: str | list[int]) -> list[int]:
        """Token ids of one prompt, length-checked; on a tokenizer thread (see _off_loop)."""
        if isinstance(prompt, str):
            self._check_chars(prompt, "prompt")
            _check_text(prompt, "prompt")
            # With the tokenizer's post-processor (BOS for Llama tokenizers), as vLLM and HF do.
            ids = self._encode(prompt, add_special_tokens=True)
        else:
            ids = list(prompt)
        self._check_prompt(ids)
        return ids

    def _check_prompt(self, ids: list[int]) -> None:
        if len(ids) > self.limits.max_prompt_tokens:
            raise ApiError(400, f"prompt has {len(ids)} tokens; this server accepts at most "
                           f"{self.limits.max_prompt_tokens}", param="prompt", code="prompt_too_long")

    def _resolve_max_tokens(self, requested: int | None, prompt_len: int) -> int:
        if requested is None:
            return max(1, min(self.limits.max_tokens, self.max_model_len - prompt_len))
        if requested > self.limits.max_tokens:
            raise ApiError(400, f"max_tokens {requested} exceeds this server's limit of {self.limits.max_tokens}",
                           param="max_tokens")
        if requested < 1:
            raise ApiError(400, "max_tokens must be at least 1", param="max_tokens")
        return requested

    def _token_text(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special_tokens=False)

    def _submit_all(self, prefix: str, jobs: list[tuple[list[int], SamplingParams]]) -> tuple[list[RequestHandle], asyncio.Queue]:
        """Submit every job with one shared output queue (tagged by job index)."""
        queue: asyncio.Queue = asyncio.Queue()
        handles: list[RequestHandle] = []
        try:
            for i, (ids, params) in enumerate(jobs):
                handles.append(self.engine.submit(self.engine.next_request_id(prefix), ids, params, queue=queue, tag=i))
        except BaseException:
            for h in handles:
                h.close()
            raise
        return handles, queue

    async def _collect(self, submitted: tuple[list[RequestHandle], asyncio.Queue], request: Request,
                       n: int) -> tuple[list[str], list[list[Any]], list[RequestOutput]] | None:
        """Run n requests to the end for a non-streamed reply: (texts, logprobs, final outputs),
        or None when the client went away first."""
        texts = [""] * n
        lps: list[list[Any]] = [[] for _ in range(n)]
        final: list[RequestOutput | None] = [None] * n
        async for i, out in self._merged(submitted, request):
            texts[i] += out.new_text
            lps[i].extend(out.new_logprobs)
            if out.finished:
                final[i] = out
        if any(f is None for f in final):
            return None
        return texts, lps, final  # type: ignore[return-value]

    async def _merged(self, submitted: tuple[list[RequestHandle], asyncio.Queue],
                      request: Request) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Outputs of several requests as they come, as (index, output); stops (and aborts all)
        when the client disconnects or the consumer stops iterating."""
        handles, queue = submitted
        gone = object()

        async def watch() -> None:
            # Polls for a client disconnect so a request still queued (no output to send yet)
            # is cancelled too.
            while not await request.is_disconnected():
                await asyncio.sleep(DISCONNECT_POLL_S)
            queue.put_nowait((-1, gone))

        watcher = asyncio.create_task(watch())
        remaining = len(handles)
        try:
            while remaining:
                i, item = await queue.get()
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
            watcher.cancel()
            for h in handles:
                h.close()

    @staticmethod
    def _sse(obj: Any) -> str:
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    async def _sse_guard(self, events: AsyncIterator[str]) -> AsyncIterator[str]:
        """Errors after the stream started go out as an SSE error event (headers are sent)."""
        try:
            async for e in events:
                yield e
        except (EngineDead, RequestFailed, RequestRejected) as exc:
            kind = "invalid_request_error" if isinstance(exc, RequestRejected) else "server_error"
            yield self._sse(error_body(str(exc), kind))
            yield "data: [DONE]\n\n"

    # ---- /v1/completions -------------------------------------------------------------------
    def _completion_logprobs(self, lps: list[TokenLogprob | None], offset: int) -> tuple[dict[str, Any], int]:
        out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for lp in lps:
            if lp is None:  # the first prompt token has no logprob
                continue
            text = self._token_text(lp.token_id)
            out["tokens"].append(text)
            out["token_logprobs"].append(lp.logprob)
            out["top_logprobs"].append({self._token_text(t): v for t, v in lp.top})
            out["text_offset"].append(offset)
            offset += len(text)
        return out, offset

    async def completions(self, body: CompletionRequest, request: Request):
        self._check_model(body.model)
        self._check_supported(body)
        if body.suffix:
            raise ApiError(400, "suffix is not supported", param="suffix")
        if body.best_of is not None and body.best_of != body.n:
            raise ApiError(400, "best_of is supported only equal to n (this server does not rank candidates)",
                           param="best_of")
        raw = body.prompt
        if isinstance(raw, str) or (raw and isinstance(raw[0], int)):
            prompts = [raw]
        else:
            prompts = list(raw)
        if not prompts:
            raise ApiError(400, "prompt must not be empty", param="prompt")
        if len(prompts) * body.n > self.limits.max_prompts:
            raise ApiError(400, f"{len(prompts)} prompts x n={body.n} exceeds this server's limit of "
                           f"{self.limits.max_prompts} per request", param="prompt")
        ids_list = await self._off_loop(lambda: [self._encode_prompt(p) for p in prompts])
        jobs = []
        for ids in ids_list:
            max_tokens = self._resolve_max_tokens(body.max_tokens, len(ids))
            for j in range(body.n):
                params = body.sampling_params(max_tokens, body.logprobs, index=j)
                if body.echo and body.logprobs is not None:
                    params = params.model_copy(update={"prompt_logprobs": True})
                jobs.append((ids, params))
        submitted = self._submit_all("cmpl", jobs)
        rid = f"cmpl-{uuid.uuid4().hex}"
        created = _now()
        n = body.n
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        def echo_text(i: int) -> str:
            return self.tokenizer.decode(ids_list[i // n], skip_special_tokens=True) if body.echo else ""

        if body.stream:
            async def events() -> AsyncIterator[str]:
                offsets = [0] * len(jobs)
                started = [False] * len(jobs)
                prompt_tokens = completion_tokens = 0
                async for i, out in self._merged(submitted, request):
                    text = out.new_text
                    lp_lists: list[TokenLogprob | None] = list(out.new_logprobs)
                    if not started[i]:
                        started[i] = True
                        text = echo_text(i) + text
                    if out.finished and out.prompt_logprobs is not None and body.echo:
                        lp_lists = [None, *out.prompt_logprobs, *lp_lists]
                    choice: dict[str, Any] = {"index": i, "text": text, "logprobs": None,
                                              "finish_reason": out.finish_reason if out.finished else None}
                    if body.logprobs is not None:
                        choice["logprobs"], offsets[i] = self._completion_logprobs(lp_lists, offsets[i])
                    if out.finished:
                        prompt_tokens += out.num_prompt_tokens
                        completion_tokens += out.num_output_tokens
                    if text or out.finished or out.new_logprobs:
                        chunk = {"id": rid, "object": "text_completion", "created": created,
                                 "model": self.model_name, "choices": [choice]}
                        if include_usage:
                            chunk["usage"] = None
                        yield self._sse(chunk)
                if include_usage:
                    yield self._sse({"id": rid, "object": "text_completion", "created": created,
                                     "model": self.model_name, "choices": [],
                                     "usage": _usage(prompt_tokens, completion_tokens)})
                yield "data: [DONE]\n\n"

            return StreamingResponse(self._sse_guard(events()), media_type="text/event-stream")

        collected = await self._collect(submitted, request, len(jobs))
        if collected is None:
            return Response(status_code=499)  # client went away; nobody reads this
        texts, lps, final = collected
        choices = []
        for i, out in enumerate(final):
            if body.echo and out.prompt_logprobs is not None:
                lps[i] = [None, *out.prompt_logprobs, *lps[i]]
            choices.append({
                "index": i, "text": echo_text(i) + texts[i], "finish_reason": out.finish_reason,
                "logprobs": self._completion_logprobs(lps[i], 0)[0] if body.logprobs is not None else None,
            })
        prompt_tokens = sum(f.num_prompt_tokens for f in final)
        completion_tokens = sum(f.num_output_tokens for f in final)
        return {"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                "choices": choices, "usage": _usage(prompt_tokens, completion_tokens)}

    # ---- /v1/chat/completions --------------------------------------------------------------
    def _chat_logprobs(self, lps: list[TokenLogprob]) -> dict[str, Any]:
        def entry(token: int, logprob: float) -> dict[str, Any]:
            text = self._token_text(token)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

        return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                            for lp in lps]}

    def _encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                     kwargs: dict[str, Any]) -> list[int]:
        """Render the chat template and tokenize it; on a tokenizer thread (see _off_loop)."""
        try:
            text = render_chat(self.tokenizer, messages, add_generation_prompt, **kwargs)
        except ChatTemplateError as exc:
            raise ApiError(400, str(exc), param="messages") from None
        self._check_chars(text, "messages")
        _check_text(text, "messages")
        ids = self._encode(text, add_special_tokens=False)  # the template already placed any special tokens
        self._check_prompt(ids)
        return ids

    def _check_supported(self, body: Any) -> None:
        field = body.unsupported_field()
        if field is not None:
            raise ApiError(400, f"{field} is not supported by this server; leave it out", param=field)

    async def chat(self, body: ChatCompletionRequest, request: Request):
        self._check_model(body.model)
        self._check_supported(body)
        try:
            messages = [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})}
                        for m in body.messages]
        except ValueError as exc:
            raise ApiError(400, str(exc), param="messages") from None
        for i, m in enumerate(body.messages):
            for field in ("tool_calls", "function_call"):
                if (m.model_extra or {}).get(field):
                    raise ApiError(400, f"messages[{i}].{field}: tool calls are not supported by this server",
                                   param=f"messages.{i}.{field}")
        kwargs = body.chat_template_kwargs or {}
        reserved = sorted(set(kwargs) & {"messages", "add_generation_prompt"})
        if reserved:
            raise ApiError(400, f"chat_template_kwargs must not set {', '.join(reserved)} (give it as a request field)",
                           param="chat_template_kwargs")
        self._check_chars("".join(m["content"] for m in messages), "messages")
        ids = await self._off_loop(self._encode_chat, messages, body.add_generation_prompt, kwargs)
        max_tokens = self._resolve_max_tokens(
            body.max_tokens if body.max_completion_tokens is None else body.max_completion_tokens, len(ids))
        top = body.top_logprobs or 0 if body.logprobs else None
        jobs = [(ids, body.sampling_params(max_tokens, top, index=j)) for j in range(body.n)]
        submitted = self._submit_all("chat", jobs)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        created = _now()
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        if body.stream:
            async def events() -> AsyncIterator[str]:
                completion_tokens = 0
                base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": self.model_name}
                extra = {"usage": None} if include_usage else {}
                for i in range(len(jobs)):
                    yield self._sse({**base, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                          "logprobs": None, "finish_reason": None}], **extra})
                async for i, out in self._merged(submitted, request):
                    if out.finished:
                        completion_tokens += out.num_output_tokens
                    if not (out.new_text or out.finished or out.new_logprobs):
                        continue
                    delta = {"content": out.new_text} if out.new_text else {}
                    choice = {"index": i, "delta": delta,
                              "logprobs": self._chat_logprobs(out.new_logprobs) if body.logprobs else None,
                              "finish_reason": out.finish_reason if out.finished else None}
                    yield self._sse({**base, "choices": [choice], **extra})
                if include_usage:
                    yield self._sse({**base, "choices": [], "usage": _usage(len(ids) * len(jobs), completion_tokens)})
                yield "data: [DONE]\n\n"

            return StreamingResponse(self._sse_guard(events()), media_type="text/event-stream")

        collected = await self._collect(submitted, request, len(jobs))
        if collected is None:
            return Response(status_code=499)
        texts, lps, final = collected
        choices = [{"index": i, "message": {"role": "assistant", "content": texts[i]},
                    "logprobs": self._chat_logprobs(lps[i]) if body.logprobs else None,
                    "finish_reason": f.finish_reason}
                   for i, f in enumerate(final)]
        completion_tokens = sum(f.num_output_tokens for f in final)
        return {"id": rid, "object": "chat.completion", "created": created, "model": self.model_name,
                "choices": choices, "usage": _usage(len(ids) * len(jobs), completion_tokens)}

    # ---- Megatron PUT /api -----------------------------------------------------------------
    async def megatron(self, request: Request):
        """Megatron-LM text_generation_server semantics: the returned text and segments include
        the prompt; logprobs cover every token after the first (prompt and generated)."""
        try:
            data = await request.json()
        except Exception:
            return JSONResponse("request body is not valid JSON", status_code=400)
        if not isinstance(data, dict) or "prompts" not in data:
            return JSONResponse("prompts argument required", status_code=400)
        try:
            body = MegatronRequest.model_validate(data)
        except ValidationError as exc:
            return JSONResponse(_validation_message(exc)[0], status_code=400)
        problem = self._megatron_problem(body)
        if problem:
            return JSONResponse(problem, status_code=400)
        greedy = body.temperature == 0.0 or body.top_k == 1
        stop = ["\n\n"] if body.stop_on_double_eol else ["\n"] if body.stop_on_eol else []
        try:
            encoded = await self._off_loop(self._encode_megatron, body)
        except ApiError as exc:
            return JSONResponse(exc.message, status_code=400)
        jobs = []
        for i, ids in enumerate(encoded):
            try:
                params = SamplingParams(
                    max_tokens=body.tokens_to_generate, temperature=0.0 if greedy else body.temperature,
                    top_k=0 if greedy else body.top_k, top_p=body.top_p if body.top_p > 0 else 1.0,
                    seed=body.random_seed + i if body.random_seed >= 0 else None, stop=stop,
                    logprobs=0 if body.logprobs else None, prompt_logprobs=body.logprobs,
                )
            except ValidationError as exc:
                return JSONResponse(_validation_message(exc)[0], status_code=400)
            jobs.append((ids, params))
        try:
            submitted = self._submit_all("api", jobs)
        except RequestRejected as exc:
            return JSONResponse(str(exc), status_code=400)
        outputs: list[list[RequestOutput]] = [[] for _ in jobs]
        async for i, out in self._merged(submitted, request):
            outputs[i].append(out)
        if any(not o or not o[-1].finished for o in outputs):
            return Response(status_code=499)
        texts, segments, logprobs = [], [], []
        eos = self.engine.eos_ids
        for (ids, _), outs in zip(jobs, outputs):
            gen = [t for o in outs for t in o.new_token_ids]
            gen_lps = [lp for o in outs for lp in o.new_logprobs]
            if gen and gen[-1] in eos:  # Megatron leaves the end-of-document token out
                gen, gen_lps = gen[:-1], gen_lps[:-1]
            texts.append(self.tokenizer.decode(ids) + "".join(o.new_text for o in outs))
            segments.append([self._token_text(t) for t in ids + gen])
            if body.logprobs:
                prompt_lps = outs[-1].prompt_logprobs or []
                logprobs.append([lp.logprob for lp in prompt_lps if lp is not None] + [lp.logprob for lp in gen_lps])
        return {"text": texts, "segments": segments, "logprobs": logprobs if body.logprobs else None}

    def _encode_megatron(self, body: MegatronRequest) -> list[list[int]]:
        out = []
        for i, prompt in enumerate(body.prompts):
            self._check_chars(prompt, f"prompt {i}")
            _check_text(prompt, f"prompt {i}")
            ids = self._encode(prompt, add_special_tokens=False)
            if body.add_BOS and self.tokenizer.bos_id is not None:
                ids = [self.tokenizer.bos_id, *ids]
            if not ids:
                raise ApiError(400, f"prompt {i} is empty")
            if len(ids) > self.limits.max_prompt_tokens:
                raise ApiError(400, f"prompt {i} has {len(ids)} tokens; the limit is {self.limits.max_prompt_tokens}")
            out.append(ids)
        return out

    def _megatron_problem(self, body: MegatronRequest) -> str | None:
        if not body.prompts:
            return "prompts is empty"
        if len(body.prompts) > self.limits.max_prompts:
            return f"Maximum number of prompts is {self.limits.max_prompts}"
        if body.tokens_to_generate < 0:
            return "tokens_to_generate must be an integer greater than or equal to 0"
        if body.tokens_to_generate > self.limits.max_tokens:
            return f"tokens_to_generate must be at most {self.limits.max_tokens}"
        if body.tokens_to_generate == 0 and not body.logprobs:
            return "tokens_to_generate=0 implies logprobs should be True"
        if not 0.0 <= body.temperature <= 100.0:
            return "temperature must be a positive number less than or equal to 100.0"
        if not 0 <= body.top_k <= 1000:
            return "top_k must be an integer between 0 and 1000"
        if not 0.0 <= body.top_p <= 1.0:
            return "top_p must be a number between 0 and 1"
        if body.top_k > 0 and body.top_p > 0.0:
            return "cannot set both top-k and top-p samplings."
        if body.random_seed < -1:
            return "random_seed must be a non-negative integer (or -1 for none)"
        return None

    # ---- app -------------------------------------------------------------------------------
    def build_app(self, api_key: str | None = None) -> FastAPI:
        engine = self.engine

        @asynccontextmanager
        async def lifespan(app: FastAPI):
            engine.start()
            try:
                yield
            finally:
                # uvicorn has stopped accepting and waited for open requests; finish the rest.
                await asyncio.to_thread(engine.shutdown, self.limits.drain_timeout_s)
                self._tokenize_pool.shutdown(wait=False, cancel_futures=True)

        app = FastAPI(title="tessera-serve", lifespan=lifespan)

        @app.exception_handler(ApiError)
        async def _api_error(request: Request, exc: ApiError):
            return error_response(exc.status, exc.message, exc.type, exc.param, exc.code)

        @app.exception_handler(RequestValidationError)
        async def _invalid(request: Request, exc: RequestValidationError):
            message, param = _validation_message(exc)
            return error_response(400, message, param=param)

        @app.exception_handler(ValidationError)
        async def _invalid_params(request: Request, exc: ValidationError):
            message, param = _validation_message(exc)
            return error_response(400, message, param=param)

        @app.exception_handler(RequestRejected)
        async def _rejected(request: Request, exc: RequestRejected):
            return error_response(400, str(exc), param=exc.param)

        @app.exception_handler(QueueFull)
        async def _full(request: Request, exc: QueueFull):
            return error_response(429, f"server busy: {exc}", "rate_limit_error", code="queue_full")

        @app.exception_handler(EngineDead)
        async def _dead(request: Request, exc: EngineDead):
            return error_response(500, str(exc), "server_error")

        @app.exception_handler(RequestFailed)
        async def _failed(request: Request, exc: RequestFailed):
            return error_response(500, f"this request failed in the engine: {exc}", "server_error")

        @app.exception_handler(StarletteHTTPException)
        async def _http(request: Request, exc: StarletteHTTPException):
            return error_response(exc.status_code, str(exc.detail), "invalid_request_error")

        @app.get("/health")
        async def health():
            if not engine.healthy:
                return error_response(503, "engine is not running", "server_error")
            return {"status": "ok"}

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": _now(),
                                                "owned_by": "tessera", "max_model_len": self.max_model_len}]}

        @app.get("/metrics")
        async def metrics():
            return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)

        @app.post("/v1/completions")
        async def completions(body: CompletionRequest, request: Request):
            return await self.completions(body, request)

        @app.post("/v1/chat/completions")
        async def chat(body: ChatCompletionRequest, request: Request):
            return await self.chat(body, request)

        @app.put("/api")
        async def megatron_api(request: Request):
            return await self.megatron(request)

        return _GuardMiddleware(app, api_key, self.limits.max_body_bytes, self.limits.body_timeout_s)  # type: ignore[return-value]


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
