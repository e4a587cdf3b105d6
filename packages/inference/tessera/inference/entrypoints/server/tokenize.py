"""POST /tokenize and /detokenize, as vLLM defines them: a client asks the server for its
tokenizer instead of loading one (prompt lengths, token budgets, exact token ids to send back)."""

from __future__ import annotations

from typing import Any

from tessera.inference.entrypoints.protocol import DetokenizeRequest, TokenizeRequest
from tessera.inference.entrypoints.server.base import ServerBase
from tessera.inference.entrypoints.server.chat import _encode_chat, chat_messages, template_kwargs
from tessera.inference.entrypoints.server.errors import ApiError, _check_text


async def tokenize(srv: ServerBase, body: TokenizeRequest) -> dict[str, Any]:
    """{"count", "max_model_len", "tokens", "token_strs"}: `prompt` tokenized as /v1/completions
    does (add_special_tokens default true), or `messages` rendered and tokenized as
    /v1/chat/completions does (default false: the template places them)."""
    srv._check_model(body.model)
    srv._check_supported(body)
    if (body.prompt is None) == (body.messages is None):
        raise ApiError(400, "give exactly one of prompt or messages", param="prompt")
    if body.continue_final_message:
        raise ApiError(400, "continue_final_message is not supported by this server; leave it out",
                       param="continue_final_message")
    if body.prompt is not None:
        prompt = body.prompt
        add_special = True if body.add_special_tokens is None else body.add_special_tokens

        def encode() -> list[int]:
            srv._check_chars(prompt, "prompt")
            _check_text(prompt, "prompt")
            ids = srv._encode(prompt, add_special)
            srv._check_prompt(ids)
            return ids

        ids = await srv._off_loop(encode)
    else:
        messages = chat_messages(body.messages or [], srv.model_name, srv.vision is not None)
        kwargs = template_kwargs(body.chat_template_kwargs)
        if body.tools:
            kwargs = {**kwargs, "tools": body.tools}
        ids = await _encode_chat(srv, messages, body.add_generation_prompt, kwargs, bool(body.add_special_tokens))
    strs = [srv.tokenizer.backend.id_to_token(t) for t in ids] if body.return_token_strs else None
    return {"count": len(ids), "max_model_len": srv.max_model_len, "tokens": ids, "token_strs": strs}


async def detokenize(srv: ServerBase, body: DetokenizeRequest) -> dict[str, Any]:
    """{"prompt": text}: the ids decoded with special tokens kept, as vLLM does."""
    srv._check_model(body.model)
    srv._check_supported(body)
    vocab = srv.engine.vocab_size
    if any(not 0 <= t < vocab for t in body.tokens):
        raise ApiError(400, f"tokens must be token ids in [0, {vocab})", param="tokens")
    if len(body.tokens) > srv.max_model_len:
        raise ApiError(400, f"at most {srv.max_model_len} tokens (max_model_len) can be detokenized", param="tokens")
    tokens = list(body.tokens)
    return {"prompt": await srv._off_loop(lambda: srv.tokenizer.decode(tokens, skip_special_tokens=False))}
