"""The HTTP server: OpenAI-compatible completions and chat (with SSE streaming), Megatron's
PUT /api, model list, health and Prometheus metrics, over one engine frontend (engine/frontend.py: EngineFrontend).

Every error is returned in OpenAI's shape {"error": {"message", "type", "param", "code"}}
(Megatron's /api keeps its own: a JSON string and status 400). Leaving a request early — client
disconnect, cancelled stream — aborts it in the engine and frees its KV blocks.

Split by endpoint family: `completions.py`, `chat.py`, `megatron.py` (each a handler over the
shared plumbing of `base.ServerBase`), `app.py` (the app factory: routes, /health, /v1/models,
/metrics, error mapping), `guard.py` (API key, body size and read time), `errors.py`.
"""

from tessera.inference.entrypoints.server.app import OpenAIServer
from tessera.inference.entrypoints.server.errors import ApiError, ServerLimits

__all__ = ["ApiError", "OpenAIServer", "ServerLimits"]
