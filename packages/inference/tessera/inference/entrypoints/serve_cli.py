"""tessera-serve: serve a checkpoint or Hugging Face export over HTTP (OpenAI-compatible API,
Megatron PUT /api, Prometheus /metrics)."""

from __future__ import annotations

import argparse
import logging
import math
import os
import re
import signal
import sys
import threading

from tessera.common.chat_template import RenderLimits
from tessera.common.errors import UserError, run_cli
from tessera.inference.engine.gc_heap import freeze_heap

EPILOG = """\
endpoints:
  POST /v1/completions        OpenAI completions (stream, stream_options.include_usage, logprobs, echo, n)
  POST /v1/chat/completions   OpenAI chat completions (the tokenizer's chat template)
  POST /v1/embeddings         OpenAI embeddings (models whose sentence-transformers files declare pooling)
  GET  /v1/models             the served model
  PUT  /api                   Megatron-LM text generation API (prompts, tokens_to_generate, ...)
  GET  /health                200 when the engine runs
  GET  /metrics               Prometheus metrics
sampling extensions (request body, as vLLM): top_k, min_p, repetition_penalty, min_tokens,
ignore_eos, stop_token_ids, skip_special_tokens. Docs: docs/cli/tessera-serve.md
"""


class _Stopped(Exception):
    """SIGTERM or SIGINT arrived: uvicorn has drained and raises it again (before it listens: at once)."""


def _stop(signum: int, frame: object) -> None:
    raise _Stopped(signum)


def _run_uvicorn(uvicorn, config, on_listening, sockets=None) -> None:
    """uvicorn.run (on `sockets` when given: a listening socket shared by several processes), calling
    `on_listening(port)` once the server listens, with the port it bound: the OS's choice under
    --port 0 (as uvicorn's own log line), read from the socket, not the flag."""
    from uvicorn.config import STARTUP_FAILURE

    class Server(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            on_listening(self.servers[0].sockets[0].getsockname()[1])

    server = Server(config)
    server.run(sockets)
    if not server.started:  # as uvicorn.run: it logged why
        sys.exit(STARTUP_FAILURE)


def _set_signal_handlers(handlers: dict) -> dict:
    """Install `handlers` (signal -> handler) and return those they replace; none off the main
    thread, where Python delivers no signal (and `signal.signal` refuses)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.signal(sig, handler) for sig, handler in handlers.items()}


def build_parser() -> argparse.ArgumentParser:
    from tessera.inference.entrypoints.engine_args import add_engine_args

    p = argparse.ArgumentParser(
        prog="tessera-serve", description=__doc__, epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(p)
    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1", help="Address to bind (default: %(default)s; 0.0.0.0 exposes it).")
    s.add_argument("--port", type=int, default=8000, help="TCP port (default: %(default)s).")
    s.add_argument("--served-model-name", default=None, help="Model id in the API (default: the checkpoint dir name).")
    s.add_argument("--api-key", default=os.environ.get("TESSERA_API_KEY"),
                   help="Require 'Authorization: Bearer KEY' on /v1 and /api (default: $TESSERA_API_KEY, else open).")
    s.add_argument("--max-prompt-tokens", type=int, default=None,
                   help="Longest prompt accepted, in tokens (default: max-model-len).")
    s.add_argument("--max-tokens-limit", type=int, default=None,
                   help="Largest max_tokens a request may ask for (default: max-model-len).")
    s.add_argument("--max-prompts-per-request", type=int, default=64,
                   help="Most prompts x n in one request (default: %(default)s).")
    s.add_argument("--max-embedding-inputs", type=int, default=256,
                   help="Most inputs in one /v1/embeddings request (default: %(default)s).")
    s.add_argument("--max-body-bytes", type=int, default=4 * 2**20, help="Largest request body (default: 4 MiB).")
    s.add_argument("--body-timeout", type=float, default=30.0,
                   help="Seconds a client has to send its whole request body; a stalled one gets 408 and "
                        "its connection is closed (default: %(default)s).")
    s.add_argument("--drain-timeout", type=float, default=30.0,
                   help="On shutdown, seconds to let running requests finish (default: %(default)s).")
    s.add_argument("--metrics-prefix", default="vllm:",
                   help="Prefix of the /metrics names (default: %(default)s, so vLLM dashboards read them; "
                        "e.g. tessera: beside a vLLM server in the same Prometheus).")
    s.add_argument("--tool-call-parser", default="auto", choices=["auto", "hermes", "llama3_json"],
                   help="How tool calls are read from text under tool_choice auto: Hermes <tool_call> JSON, "
                        "Llama-3 JSON, or auto (hermes when the chat template teaches <tool_call>).")
    t = RenderLimits()
    s.add_argument("--chat-template-timeout", type=float, default=t.timeout_s, metavar="S",
                   help="Seconds one chat template render may take; a request whose render runs longer gets 400 "
                        "(default: %(default)s).")
    s.add_argument("--chat-template-max-iterations", type=int, default=t.max_iterations, metavar="N",
                   help="Loop iterations and macro calls one chat template render may run (default: %(default)s).")
    s.add_argument("--chat-template-max-chars", type=int, default=t.max_chars, metavar="N",
                   help="Characters of a rendered chat prompt, and of any string or list a template builds "
                        "(default: %(default)s).")
    s.add_argument("--chat-template-max-memory", type=int, default=t.max_memory_mb, metavar="MIB",
                   help="Memory (address space, MiB) a chat template render process may add to its own "
                        "(default: %(default)s).")
    add_grammar_limit_args(p)
    from tessera.inference.core.image_inputs import add_image_limit_args

    add_image_limit_args(s)
    s.add_argument("--quiet", action="store_true", help="Log warnings only (no access log).")
    s.add_argument("--api-server-count", "-asc", type=int, default=1, metavar="N",
                   help="HTTP server processes sharing the port in front of the one engine process (vLLM's "
                        "flag): tokenizing, detokenized streaming and JSON then use N cores. Not with "
                        "--no-engine-process (default: %(default)s).")
    s.add_argument("--no-engine-process", action="store_true",
                   help="Run the engine in a thread of the HTTP process instead of its own process "
                        "(slower under load: the two then share one GIL; for debugging).")
    return p


def add_grammar_limit_args(p: argparse.ArgumentParser) -> None:
    """One flag per structured_limits.GrammarLimits field, its description the help."""
    from tessera.inference.core.structured_limits import FLAGS, GrammarLimits
    from tessera.inference.entrypoints.engine_args import parse_bytes

    g = p.add_argument_group("structured output limits, per request (docs/security.md)")
    d = GrammarLimits()
    for name, info in GrammarLimits.model_fields.items():
        kind = parse_bytes if name == "check_memory_bytes" else type(getattr(d, name))
        g.add_argument(FLAGS[name], dest=name, type=kind, default=getattr(d, name), metavar="N",
                       help=f"{info.description.rstrip('.')} (default: %(default)s).")


def grammar_limits_from_args(args: argparse.Namespace):
    from pydantic import ValidationError

    from tessera.inference.core.structured_limits import FLAGS, GrammarLimits

    values = {name: getattr(args, name) for name in GrammarLimits.model_fields}
    try:
        return GrammarLimits.model_validate(values)
    except ValidationError as exc:
        err = exc.errors()[0]
        name = str(err["loc"][0])
        raise UserError(f"{FLAGS[name]} {values[name]}: {err['msg']}") from None


def check_args(args: argparse.Namespace, argv: list[str] | None):
    """Every flag's check that needs no model (one line, exit 2): the engine config and grammar limits."""
    from tessera.inference.entrypoints.engine_args import engine_config_from_args

    cfg = engine_config_from_args(args)
    grammar_limits = grammar_limits_from_args(args)
    if not 0 <= args.port < 65536:
        raise UserError(f"--port {args.port}: must be between 0 (any free port) and 65535")
    for flag in ("max_prompt_tokens", "max_tokens_limit", "max_prompts_per_request", "max_embedding_inputs",
                 "max_body_bytes",
                 "chat_template_max_iterations", "chat_template_max_chars", "chat_template_max_memory"):
        value = getattr(args, flag)
        if value is not None and value <= 0:
            raise UserError(f"--{flag.replace('_', '-')} {value}: must be positive")
    if not (args.drain_timeout >= 0 and math.isfinite(args.drain_timeout)):
        raise UserError(f"--drain-timeout {args.drain_timeout}: must be a number of seconds >= 0")
    if not re.fullmatch(r"([a-zA-Z_:][a-zA-Z0-9_:]*)?", args.metrics_prefix):
        raise UserError(f"--metrics-prefix {args.metrics_prefix!r}: letters, digits, _ and : only, not starting "
                        "with a digit (a Prometheus metric name prefix)")
    if not (args.chat_template_timeout > 0 and math.isfinite(args.chat_template_timeout)):
        raise UserError(f"--chat-template-timeout {args.chat_template_timeout}: must be a number of seconds > 0")
    if not (args.body_timeout > 0 and math.isfinite(args.body_timeout)):
        raise UserError(f"--body-timeout {args.body_timeout}: must be a number of seconds > 0")
    if args.api_server_count < 1:
        raise UserError(f"--api-server-count {args.api_server_count}: must be >= 1")
    if args.api_server_count > 1 and args.no_engine_process:
        # The engine in a thread of one HTTP process cannot be shared with another process.
        raise UserError(f"--api-server-count {args.api_server_count}: needs the engine in its own process; "
                        "drop --no-engine-process")
    if args.api_key is not None and not args.api_key.strip():
        # The README's `--api-key "$KEY"` with KEY unset would otherwise start an open server.
        given = argv if argv is not None else sys.argv[1:]
        on_line = any(a == "--api-key" or a.startswith("--api-key=") for a in given)
        source = "--api-key" if on_line else "$TESSERA_API_KEY"
        raise UserError(f"{source} is empty: give a non-empty key, or leave it out for a server without one")
    if not os.path.exists(args.checkpoint):
        raise UserError(f"{args.checkpoint}: checkpoint not found (pass a run dir, checkpoints dir, "
                        "iter_NNNNNNN dir or Hugging Face export dir)")
    return cfg, grammar_limits


def build_server(args: argparse.Namespace, frontend, grammar_limits, name: str, api_server: int | None = None):
    """The ASGI app of one HTTP process over `frontend` (its metrics: this process's share when one
    of several, `api_server` its index)."""
    from tessera.inference.core.image_inputs import image_limits
    from tessera.inference.engine.metrics import ServingMetrics
    from tessera.inference.entrypoints.server import OpenAIServer, ServerLimits

    metrics = ServingMetrics(name, args.metrics_prefix, frontend.max_model_len, api_server=api_server)
    frontend.metrics = metrics
    limits = ServerLimits(
        max_prompt_tokens=args.max_prompt_tokens or frontend.max_model_len,
        max_tokens=args.max_tokens_limit or frontend.max_model_len,
        max_prompts=args.max_prompts_per_request, max_embedding_inputs=args.max_embedding_inputs,
        max_body_bytes=args.max_body_bytes,
        drain_timeout_s=args.drain_timeout, body_timeout_s=args.body_timeout,
        chat_template=RenderLimits(timeout_s=args.chat_template_timeout, max_iterations=args.chat_template_max_iterations,
                                   max_chars=args.chat_template_max_chars, max_memory_mb=args.chat_template_max_memory),
        grammar=grammar_limits, images=image_limits(args),
    )
    server = OpenAIServer(frontend, name, limits, metrics)
    server.tool_call_parser = args.tool_call_parser
    return server.build_app(api_key=args.api_key)


def startup_line(args: argparse.Namespace, cfg, name: str, dtype, device, facts: dict, plan, max_model_len: int,
                 pooling, generates: bool) -> str:
    """The line printed once the server listens (the port is appended then)."""
    from tessera.inference.worker.cpu_threads import describe_measured

    quant = f", {cfg.quantization} weights" if cfg.quantization else ""
    quant += f", tensor parallel {cfg.tensor_parallel}" if cfg.tensor_parallel > 1 else ""
    quant += f", {cfg.kv_cache_dtype} KV cache" if cfg.kv_cache_dtype != "auto" else ""
    quant += ", checksums not verified" if cfg.skip_checksum_verify else ""
    quant += f", layers compiled in {facts['compile_s']:.1f} s" if facts.get("compile_s") else ""
    if pooling is not None:  # /v1/embeddings is served (worker/pooling/spec.py)
        mode = {"last": "last-token", "cls": "CLS"}.get(pooling.mode, pooling.mode)
        quant += (f", embeddings by {mode} pooling{' (normalized)' if pooling.normalize else ''} of inputs up to "
                  f"{pooling.max_input_tokens} tokens{'' if generates else ' only'}")
    return (f"tessera-serve: model {name!r} ({facts['arch']}, {dtype}{quant}, {device}; {facts['where']}), "
            f"{facts['num_blocks']} KV blocks x {cfg.block_size} tokens, "
            f"{facts['state_pool'] + ', ' if facts.get('state_pool') else ''}max_model_len {max_model_len}; "
            f"{describe_measured(facts['threads'], plan)}; listening on http://{args.host}")


def serve_app(args: argparse.Namespace, app, frontend, on_listening, sockets=None, close_engine=None) -> None:
    """Run uvicorn until SIGTERM/SIGINT has drained it (a success), then stop `frontend`."""
    import uvicorn

    level = logging.WARNING if args.quiet else logging.INFO
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # uvicorn drains on SIGTERM/SIGINT, then raises the signal again under the handlers it found: these,
    # so a stop ends here, through the cleanup below, with exit 0, not killed by SIGTERM's default
    # action (which skips the cleanup). Once stopping, a repeated SIGTERM is ignored (schedulers
    # repeat it) and a second Ctrl-C interrupts at once, as the trainer's (docs/operations.md).
    found = _set_signal_handlers({signal.SIGINT: _stop, signal.SIGTERM: _stop})
    freeze_heap()
    try:
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning" if args.quiet else "info",
                                access_log=not args.quiet, timeout_graceful_shutdown=math.ceil(args.drain_timeout))
        _run_uvicorn(uvicorn, config, on_listening, sockets)
    except _Stopped:
        pass  # drained and stopped: a success
    finally:
        if found:
            _set_signal_handlers({signal.SIGTERM: signal.SIG_IGN, signal.SIGINT: signal.default_int_handler})
        try:
            if frontend.healthy:  # uvicorn never got to its shutdown (e.g. the port was taken)
                frontend.shutdown(timeout=0)
        finally:
            try:
                if close_engine is not None:  # stops tensor-parallel workers, even after a Ctrl-C in the above
                    close_engine()
            finally:
                _set_signal_handlers(found)


def check_metrics_dir(args: argparse.Namespace) -> None:
    """`PROMETHEUS_MULTIPROC_DIR` set beforehand (not a flag, so not in check_args, which each HTTP
    process of several runs under the launcher's own directory): prometheus_client writes every
    metric into it, so a missing one failed only after the model loaded. Several HTTP processes
    need a fresh directory (stale files would be summed in): the launcher makes and removes its own."""
    where = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if not where:
        return
    if args.api_server_count > 1:
        raise UserError(f"--api-server-count {args.api_server_count}: PROMETHEUS_MULTIPROC_DIR is set ({where}); "
                        "tessera-serve makes and removes its own metrics directory: unset it")
    if not os.path.isdir(where):
        raise UserError(f"PROMETHEUS_MULTIPROC_DIR={where}: not a directory (prometheus_client writes the metrics "
                        "there); create it or unset it")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cfg, grammar_limits = check_args(args, argv)
    check_metrics_dir(args)
    from tessera.inference.worker.loader import resolve_device, resolve_dtype

    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    if device.type == "cpu" and str(dtype) == "torch.float16":
        raise UserError("--dtype float16 is not supported on CPU; use float32")
    from tessera.inference.worker.quantization import check_quantization

    check_quantization(cfg.quantization, device)  # before the engine process reads any weight
    from tessera.inference.spec_decode.proposers import check_draft_model, read_model_facts
    from tessera.inference.worker.kinds import serving_kind

    check_draft_model(cfg.speculative, args.checkpoint)
    from tessera.inference.worker.cuda_graphs import check_cuda_graphs

    check_cuda_graphs(cfg, device)  # flags first, then what the checkpoint says
    serving_kind(read_model_facts(args.checkpoint)[0])  # a kind this server cannot run: before the engine starts
    from tessera.inference.worker.cpu_threads import apply_binding, measure, plan_for_this_machine

    # CPU compute threads and cores as vLLM's CPU build picks them, unless --torch-threads says (worker/cpu_threads.py).
    plan = None
    if device.type == "cpu" or args.torch_threads is not None:
        plan = plan_for_this_machine(cfg.tensor_parallel, not args.no_engine_process, args.torch_threads)
    if args.api_server_count > 1:
        from tessera.inference.entrypoints.api_servers import run_api_servers

        return run_api_servers(args, list(argv) if argv is not None else sys.argv[1:], cfg, plan, dtype, device,
                               startup_line)
    if args.no_engine_process:
        from tessera.inference.engine.frontend import AsyncEngine
        from tessera.inference.engine.llm_engine import LLMEngine
        from tessera.inference.worker.loader import load_for_serving

        if plan is not None:
            apply_binding(plan.engine)
        loaded = load_for_serving(args.checkpoint, device, dtype, cfg.quantization, cfg.tensor_parallel,
                                  kv_cache_dtype=cfg.kv_cache_dtype, skip_checksum_verify=cfg.skip_checksum_verify,
                                  generation_config=cfg.generation_config)
        engine = LLMEngine(loaded, cfg, device, dtype, plan.workers if plan is not None and plan.workers else None)
        frontend = AsyncEngine(engine)
        facts = {"name": loaded.name, "arch": loaded.config.arch, "num_blocks": engine.blocks.num_blocks,
                 "state_pool": engine.runner.state_summary(),
                 "where": "engine thread", "compile_s": engine.compile_seconds, "threads": measure(engine)}
    else:
        from tessera.inference.engine.process_client import ProcessEngine

        frontend = ProcessEngine.launch(args.checkpoint, cfg, plan)
        facts = {**frontend.info, "where": f"engine process {frontend.pid}"}
    name = args.served_model_name or facts["name"]
    app = build_server(args, frontend, grammar_limits, name)
    line = startup_line(args, cfg, name, dtype, device, facts, plan, frontend.max_model_len, frontend.pooling,
                        frontend.generates)
    if frontend.generates and frontend.generation_defaults.applies:  # the model's request defaults (vLLM logs them too)
        print(f"tessera-serve: {frontend.generation_defaults.describe()}", file=sys.stderr, flush=True)
    # (the engine thread closes the engine too; the engine process does so itself)
    serve_app(args, app, frontend, lambda port: print(f"{line}:{port}", file=sys.stderr, flush=True),
              close_engine=frontend.engine.close if args.no_engine_process else None)
    return 0


def entry() -> None:
    run_cli(main)
