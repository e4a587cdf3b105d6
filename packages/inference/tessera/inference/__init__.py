"""tessera-serve: KV-cached, continuously batching text generation, OpenAI-compatible HTTP server."""
