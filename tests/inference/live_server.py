"""A real uvicorn server on a port it bound (port 0) over the in-process (thread) engine, for HTTP tests.
`stop()` fails the test if a process the server started (tensor-parallel workers, tokenizer,
template or grammar-check children) outlives it."""

from __future__ import annotations

import time

from inference_helpers import make_engine
from ports import start_uvicorn
from process_tree import assert_gone, descendants

from tessera.inference.engine.frontend import AsyncEngine
from tessera.inference.engine.metrics import ServingMetrics
from tessera.inference.entrypoints.server import OpenAIServer, ServerLimits


class LiveServer:
    live: set[LiveServer] = set()  # started and not yet stopped: their children are not a leak of another's

    def __init__(self, ckpt, api_key=None, limits=None, **engine_cfg):
        self._before = {p.pid for p in descendants()}
        self.engine = make_engine(ckpt, **engine_cfg)
        try:
            self._start(api_key, limits)
        except BaseException:
            self.engine.close()  # its tensor-parallel workers, if any: a failed start leaves none
            raise
        LiveServer.live.add(self)

    def _start(self, api_key, limits) -> None:
        metrics = ServingMetrics("tiny")
        limits = limits or ServerLimits(max_prompt_tokens=64, max_tokens=100, max_prompts=4, max_body_bytes=20_000)
        self.async_engine = AsyncEngine(self.engine, metrics)
        self.openai = OpenAIServer(self.async_engine, "tiny", limits, metrics)
        app = self.openai.build_app(api_key=api_key)
        self.server, self.thread, self.url = start_uvicorn(app)
        self.port = int(self.url.rsplit(":", 1)[1])

    def own_pids(self) -> set[int]:
        """The child processes this server holds now."""
        executor = getattr(self.engine.runner, "executor", None)
        pids = {p.pid for p in getattr(executor, "procs", ())}
        for pool in (self.openai._tokenize_procs, self.openai._template_procs):
            pids |= {c.process.pid for c in list(pool._running)}
        return pids | {c.process.pid for c in list(self.openai.grammar_check._children)}

    def stop(self):
        """Stop as tessera-serve stops (uvicorn's shutdown, then the app's), then check by pid that
        every process started since this server started has ended (another live server's aside)."""
        LiveServer.live.discard(self)
        self.server.should_exit = True
        self.thread.join(timeout=60)
        assert not self.thread.is_alive(), "the server did not stop within 60 s"
        others = set().union(*(s.own_pids() for s in LiveServer.live))
        assert_gone([p for p in descendants() if p.pid not in self._before | others], "LiveServer.stop()")

    def wait_idle(self, timeout=30.0):
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.engine.blocks.num_used == 0 and not self.engine.has_unfinished() and self.async_engine.num_active() == 0:
                return True
            time.sleep(0.05)
        return False


def streamed_with_and_without_async_scheduling(ckpt, bodies: list[dict], **engine_cfg
                                               ) -> dict[bool, list[tuple[str, str]]]:
    """Each of `bodies` streamed at once through the `openai` client from a live server with and
    without --async-scheduling (keyed by the flag): per body, its text and finish reason.
    `engine_cfg`: more of the engine's settings (tensor_parallel)."""
    import concurrent.futures as cf

    from openai import OpenAI

    def texts(server) -> list[tuple[str, str]]:
        client = OpenAI(base_url=server.url + "/v1", api_key="unused")

        def one(body):
            chunks = list(client.completions.create(model="tiny", stream=True, **body))
            return "".join(c.choices[0].text for c in chunks if c.choices), next(
                c.choices[0].finish_reason for c in reversed(chunks) if c.choices and c.choices[0].finish_reason)
        with cf.ThreadPoolExecutor(len(bodies)) as pool:
            return list(pool.map(one, bodies))

    got = {}
    for overlap in (True, False):
        server = LiveServer(ckpt, block_size=4, num_kv_blocks=200, max_num_seqs=8, enforce_eager=True,
                            async_scheduling=overlap, **engine_cfg)
        try:
            got[overlap] = texts(server)
            assert server.wait_idle()
        finally:
            server.stop()
    return got
