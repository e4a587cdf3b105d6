"""The ASGI guard in front of every route: API key, body size, body read time and JSON depth."""

from __future__ import annotations

import asyncio
import hmac

from tessera.inference.core.json_depth import depth_problem
from tessera.inference.entrypoints.server.errors import error_response

RAW_SEND = "tessera.raw_send"  # scope key
# Paths outside /v1 and /v2 that the API key guards too (every request route but /health and /metrics).
_KEYED = ("/api", "/tokenize", "/detokenize", "/score", "/rerank")


class _GuardMiddleware:
    """Pure ASGI, in front of every route: the API-key check on /v1, /v2 and _KEYED, then the whole
    request body read here, bounded in size (400) and in time (408, connection closed: a client
    that stalls mid-body cannot hold a connection open), and refused (400) when it nests deeper
    than json_depth.MAX_JSON_DEPTH, before any handler parses it."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int, body_timeout_s: float):
        self.app, self.api_key, self.max_body, self.body_timeout = app, api_key, max_body_bytes, body_timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        headers = dict(scope.get("headers") or [])
        if self.api_key and (path.startswith(("/v1", "/v2")) or path in _KEYED):
            given = headers.get(b"authorization", b"").decode("latin-1")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
                resp = error_response(401, "missing or invalid API key; send 'Authorization: Bearer <key>'",
                                      "authentication_error", code="invalid_api_key")
                return await resp(scope, receive, send)
        def too_big():  # built only when needed: rendering it costs as much as a streamed token
            return error_response(400, f"request body exceeds {self.max_body} bytes", code="request_too_large",
                                  headers={"connection": "close"})

        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            return await too_big()(scope, receive, send)
        try:
            body, disconnected = await asyncio.wait_for(self._read_body(receive), self.body_timeout)
        except TimeoutError:
            slow = error_response(408, f"request body not received within {self.body_timeout:g} s",
                                  code="request_timeout", headers={"connection": "close"})
            return await slow(scope, receive, send)
        except _BodyTooLarge:
            return await too_big()(scope, receive, send)
        if disconnected:
            return None
        problem = depth_problem(body) if body and scope.get("method") in ("POST", "PUT", "PATCH") else None
        if problem is not None:
            deep = error_response(400, f"the request body {problem}", code="json_too_deep")
            return await deep(scope, receive, send)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: only http.disconnect comes

        scope[RAW_SEND] = send  # the server's own send, for SSE events (server/base.py SseResponse)
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
