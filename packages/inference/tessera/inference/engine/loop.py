"""The one loop that drives an `LLMEngine` behind the server, in both modes: a thread of the HTTP
process (`frontend.AsyncEngine`) and the engine process (`core_process`). Only where commands
come from and where each step's results go differ; the mode supplies those two functions.

Commands, in arrival order: ("add", request_id, prompt_ids, SamplingParams) | ("abort", request_id)
| ("stop",). `receive(block)` returns the commands that have arrived, waiting for at least one when
`block` (the engine is idle). `emit(outputs, failed, stats, num_adds)` gets each step's outputs,
the adds the engine refused as (request_id, message), the engine's stats, and how many adds the
loop has taken so far.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tessera.inference.engine.llm_engine import EngineStats, LLMEngine, RequestOutput

Command = tuple[Any, ...]


def run_engine_loop(engine: LLMEngine, receive: Callable[[bool], list[Command]],
                    emit: Callable[[list[RequestOutput], list[tuple[str, str]], EngineStats, int], None]) -> None:
    """Step the engine until a ("stop",) command; exceptions of receive/emit end the loop."""
    num_adds = 0
    while True:
        failed: list[tuple[str, str]] = []
        for cmd in receive(not engine.has_unfinished()):
            if cmd[0] == "add":
                num_adds += 1
                try:
                    engine.add_request(cmd[1], cmd[2], cmd[3])
                except Exception as exc:  # validated by the HTTP process already; a bug if it fails here
                    failed.append((cmd[1], f"{type(exc).__name__}: {exc}"))
            elif cmd[0] == "abort":
                engine.abort(cmd[1])
            elif cmd[0] == "stop":
                return
        outputs = engine.step() if engine.has_unfinished() else []
        emit(outputs, failed, engine.stats(), num_adds)
