"""One HTTP process of `tessera-serve --api-server-count N` (`python -m
tessera.inference.entrypoints.api_server_process LISTEN_FD ENGINE_FD CONTROL_FD`, started by
api_servers.py's launcher): the flags and the engine's facts arrive over the control pipe, then it
serves the inherited socket as one `tessera-serve` does, over its own pipe to the engine process.
A module of its own, apart from the launcher: it imports serve_cli, which imports the launcher."""

from __future__ import annotations

import json
import os
import socket
import sys
from multiprocessing.connection import Connection


def child_main(argv: list[str]) -> int:
    """One HTTP process (see the module doc); `argv`: LISTEN_FD ENGINE_FD CONTROL_FD."""
    from tessera.inference.engine.process_client import ProcessEngine
    from tessera.inference.entrypoints.serve_cli import build_parser, build_server, check_args, serve_app
    from tessera.inference.worker.tensor_parallel.worker import die_with_parent

    listen_fd, engine_fd, control_fd = map(int, argv)
    control = Connection(control_fd)
    init = json.loads(control.recv_bytes())
    die_with_parent(int(init["launcher"]))
    args = build_parser().parse_args(init["argv"])
    cfg, grammar_limits = check_args(args, init["argv"])
    info = init["info"]
    index = int(init["index"])
    frontend = ProcessEngine.connect(Connection(engine_fd), info, cfg.max_waiting)
    frontend.request_id_tag = str(index)
    app = build_server(args, frontend, grammar_limits, args.served_model_name or info["name"], api_server=index)

    def listening(port: int) -> None:
        control.send_bytes(b"listening")

    serve_app(args, app, frontend, listening, sockets=[socket.socket(fileno=listen_fd)])
    return 0


def _child_entry(argv: list[str] | None) -> int:
    code = child_main(sys.argv[1:])
    # Drained and closed: skip the interpreter's teardown, a full collection of every module that took
    # seconds here with N processes ending at once (the launcher waits for each to exit).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    from tessera.common.errors import run_cli

    run_cli(_child_entry)
