"""Errors in OpenAI's shape, the limits every handler enforces, and small shared helpers."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from tessera.common.chat_template import RenderLimits
from tessera.inference.core.image_inputs import ImageLimits
from tessera.inference.core.structured_limits import GrammarLimits


@dataclass
class ServerLimits:
    max_prompt_tokens: int
    max_tokens: int
    max_prompts: int = 64
    max_embedding_inputs: int = 256  # inputs of one /v1/embeddings request (each is one engine request)
    max_body_bytes: int = 4 * 2**20
    drain_timeout_s: float = 30.0
    body_timeout_s: float = 30.0  # a request body must arrive within this (a stalled one is dropped)
    tokenizer_threads: int = 2  # prompts are tokenized and templates rendered here, off the event loop
    tokenize_timeout_s: float = 60.0  # a long text's tokenizing (in a child process) must end within this (503)
    chat_template: RenderLimits = field(default_factory=RenderLimits)  # each render's bounds (400 past one)
    grammar: GrammarLimits = field(default_factory=GrammarLimits)  # structured output (structured_limits.py)
    images: ImageLimits = field(default_factory=ImageLimits)  # image parts of chat messages (server/images.py)


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


def _check_text(text: str, what: str) -> None:
    """JSON can carry a lone surrogate escape (\\udc80) that is no Unicode text; the tokenizer cannot take it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ApiError(400, f"{what} is not valid Unicode: lone surrogate {text[exc.start]!r} at character "
                       f"{exc.start}; send UTF-8 text", param=what.split()[0]) from None


def _now() -> int:
    return int(time.time())


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
