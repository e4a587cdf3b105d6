"""A real uvicorn server on a free port over the in-process (thread) engine, for HTTP tests."""

from __future__ import annotations

import socket
import threading
import time

from inference_helpers import make_engine

from tessera.inference.engine.frontend import AsyncEngine
from tessera.inference.engine.metrics import ServingMetrics
from tessera.inference.entrypoints.server import OpenAIServer, ServerLimits


class LiveServer:
    def __init__(self, ckpt, api_key=None, limits=None, **engine_cfg):
        import uvicorn

        self.engine = make_engine(ckpt, **engine_cfg)
        metrics = ServingMetrics("tiny")
        limits = limits or ServerLimits(max_prompt_tokens=64, max_tokens=100, max_prompts=4, max_body_bytes=20_000)
        self.async_engine = AsyncEngine(self.engine, metrics)
        self.openai = OpenAIServer(self.async_engine, "tiny", limits, metrics)
        app = self.openai.build_app(api_key=api_key)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            assert time.time() < deadline, "server did not start"
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self):
        self.server.should_exit = True
        self.thread.join(timeout=30)

    def wait_idle(self, timeout=30.0):
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.engine.blocks.num_used == 0 and not self.engine.has_unfinished() and self.async_engine.num_active() == 0:
                return True
            time.sleep(0.05)
        return False
