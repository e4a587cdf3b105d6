"""The app factory: routes of every endpoint family, error mapping, lifespan, and the guard."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from tessera.inference.engine.frontend import EngineDead, QueueFull, RequestFailed
from tessera.inference.engine.llm_engine import RequestRejected
from tessera.inference.entrypoints.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    RerankRequest,
    ScoreRequest,
    TokenizeRequest,
)
from tessera.inference.entrypoints.server import chat as chat_api
from tessera.inference.entrypoints.server import completions as completions_api
from tessera.inference.entrypoints.server import embeddings as embeddings_api
from tessera.inference.entrypoints.server import megatron as megatron_api
from tessera.inference.entrypoints.server import score as score_api
from tessera.inference.entrypoints.server import tokenize as tokenize_api
from tessera.inference.entrypoints.server.base import ServerBase
from tessera.inference.entrypoints.server.errors import ApiError, _now, _validation_message, error_response
from tessera.inference.entrypoints.server.guard import _GuardMiddleware


class OpenAIServer(ServerBase):
    """Builds the FastAPI app: one route per endpoint, each handled by its family's module."""

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
                self._render_pool.shutdown(wait=False, cancel_futures=True)
                self._tokenize_procs.close()
                self._template_procs.close()
                self.grammar_check.close()

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
            if exc.client:
                return error_response(400, str(exc), code="grammar_limit")
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
        async def completions_route(body: CompletionRequest, request: Request):
            return await completions_api.completions(self, body, request)

        @app.post("/v1/chat/completions")
        async def chat_route(body: ChatCompletionRequest, request: Request):
            return await chat_api.chat(self, body, request)

        @app.post("/v1/embeddings")
        async def embeddings_route(body: EmbeddingRequest, request: Request):
            return await embeddings_api.embeddings(self, body, request)

        # vLLM's paths: /score and /rerank bare and under /v1, and /v2/rerank (Cohere's v2 client).
        @app.post("/score")
        @app.post("/v1/score")
        async def score_route(body: ScoreRequest, request: Request):
            return await score_api.score(self, body, request)

        @app.post("/rerank")
        @app.post("/v1/rerank")
        @app.post("/v2/rerank")
        async def rerank_route(body: RerankRequest, request: Request):
            return await score_api.rerank(self, body, request)

        @app.post("/tokenize")
        async def tokenize_route(body: TokenizeRequest):
            return await tokenize_api.tokenize(self, body)

        @app.post("/detokenize")
        async def detokenize_route(body: DetokenizeRequest):
            return await tokenize_api.detokenize(self, body)

        @app.put("/api")
        async def megatron_route(request: Request):
            return await megatron_api.megatron(self, request)

        return _GuardMiddleware(app, api_key, self.limits.max_body_bytes, self.limits.body_timeout_s)  # type: ignore[return-value]
