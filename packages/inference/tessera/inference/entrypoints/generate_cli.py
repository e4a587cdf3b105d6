"""tessera-generate: offline batch generation through the serving engine (same scheduler, KV
cache and sampler as tessera-serve), JSONL in, JSONL out, in input order.

Input lines: {"prompt": "text" | [token ids]} or {"messages": [{"role", "content"}, ...]} (rendered
with the tokenizer's chat template), optionally "id" and any SamplingParams field (max_tokens,
temperature, top_p, top_k, min_p, seed, stop, stop_token_ids, logprobs, ...) overriding the flags.
Output lines: {"id", "text", "token_ids", "finish_reason", "prompt_tokens", "completion_tokens"}
(+ "logprobs" when asked).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from tessera.common.errors import UserError, run_cli
from tessera.common.fileio import ensure_output_dir


def build_parser() -> argparse.ArgumentParser:
    from tessera.inference.entrypoints.engine_args import add_engine_args

    p = argparse.ArgumentParser(prog="tessera-generate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(p)
    io = p.add_argument_group("input/output")
    io.add_argument("--prompts", required=True, help="JSONL file of prompts (see above).")
    io.add_argument("--output", required=True, help="JSONL file to write (replaced atomically when complete).")
    s = p.add_argument_group("default sampling (a line's own fields win; then these flags; then the model's "
                             "generation_config defaults, see --generation-config; then the built-in ones below)")
    s.add_argument("--max-tokens", type=int, default=None, help="Tokens to generate per prompt (built-in: 64).")
    s.add_argument("--temperature", type=float, default=None, help="0 = greedy (built-in: 0).")
    s.add_argument("--top-p", type=float, default=None, help="Nucleus sampling mass (built-in: 1).")
    s.add_argument("--top-k", type=int, default=None, help="Top-k sampling, 0 = off (built-in: 0).")
    p.add_argument("--quiet", action="store_true", help="No progress bar.")
    return p


# tessera-generate's own defaults where neither a line, a flag nor the model's settings say.
BUILT_IN = {"max_tokens": 64, "temperature": 0.0, "top_p": 1.0, "top_k": 0}


def generation_defaults(checkpoint: str, cfg):
    """The model's request defaults under --generation-config / --override-generation-config (read
    from the generation_config.json or sidecar record alone, before any weight loads)."""
    from tessera.inference.core.generation_defaults import resolve_defaults
    from tessera.inference.worker.loader import read_generation

    record, source = read_generation(checkpoint, cfg.generation_config)
    return resolve_defaults(record, cfg.generation_config, cfg.override_generation_config, source)


def read_prompts(path: Path, defaults: dict[str, Any]) -> list[tuple[str, dict[str, Any], Any, bool]]:
    """(id, sampling fields, prompt-or-messages, whether the line sets max_tokens) per line, all
    validated before any work."""
    if not path.is_file():
        raise UserError(f"{path}: prompts file not found")
    try:
        jobs = _read_lines(path, defaults)
    except UnicodeDecodeError:
        raise UserError(f"{path}: not UTF-8 text; --prompts takes a JSONL file") from None
    if not jobs:
        raise UserError(f"{path}: no prompts found")
    return jobs


def _read_lines(path: Path, defaults: dict[str, Any]) -> list[tuple[str, dict[str, Any], Any, bool]]:
    from tessera.inference.core.sampling_params import SamplingParams

    jobs = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise UserError(f"{where}: not valid JSON ({exc.msg})") from None
            if not isinstance(obj, dict):
                raise UserError(f"{where}: expected a JSON object with 'prompt' or 'messages'")
            try:
                json.dumps(obj, ensure_ascii=False).encode("utf-8")
            except UnicodeEncodeError:
                raise UserError(f"{where}: holds a lone surrogate escape (such as \\udc80), which is not Unicode "
                                "text; fix the line") from None
            rid = str(obj.pop("id", lineno))
            if "prompt" in obj:
                source = ("prompt", obj.pop("prompt"))
                ok = isinstance(source[1], str) or (isinstance(source[1], list) and all(isinstance(t, int) for t in source[1]))
                if not ok:
                    raise UserError(f"{where}: 'prompt' must be a string or a list of token ids")
            elif "messages" in obj:
                source = ("messages", obj.pop("messages"))
                if not isinstance(source[1], list) or not all(isinstance(m, dict) for m in source[1]):
                    raise UserError(f"{where}: 'messages' must be a list of {{role, content}} objects")
            else:
                raise UserError(f"{where}: needs a 'prompt' or 'messages' field")
            fields = {**defaults, **obj}
            try:
                SamplingParams(**fields)
            except ValidationError as exc:
                err = exc.errors()[0]
                loc = ".".join(str(x) for x in err["loc"]) or "sampling"
                raise UserError(f"{where}: {loc}: {err['msg']}") from None
            jobs.append((rid, fields, source, "max_tokens" in obj))
    return jobs


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from tessera.inference.entrypoints.engine_args import engine_config_from_args

    cfg = engine_config_from_args(args)
    flags = {k: v for k, v in {"max_tokens": args.max_tokens, "temperature": args.temperature, "top_p": args.top_p,
                                "top_k": args.top_k}.items() if v is not None}
    jobs = read_prompts(Path(args.prompts), {**BUILT_IN, **flags})  # the file's own problems first
    out_path = Path(args.output)
    if out_path.is_dir():
        raise UserError(f"{out_path}: is a directory; pass a file path for --output")
    if out_path.exists() and out_path.resolve() == Path(args.prompts).resolve():
        raise UserError(f"{out_path}: --output is the --prompts file; write the completions elsewhere")
    ckpt = Path(args.checkpoint)
    # abspath too: a hub snapshot's files are links to its blobs, and the write replaces the link
    if out_path.exists() and any(c in o.parents for c in (ckpt.resolve(), Path(os.path.abspath(ckpt)))
                                 for o in (out_path.resolve(), Path(os.path.abspath(out_path)))):
        # e.g. --output <hf dir>/config.json replaced the model's config by the completions (exit 0)
        raise UserError(f"{out_path}: --output is a file of the --checkpoint {args.checkpoint}; write the completions "
                        "elsewhere")
    ensure_output_dir(out_path.parent, "--output")
    # The model's request defaults: read from its generation settings alone, before any weight loads.
    model_defaults = generation_defaults(args.checkpoint, cfg)
    if model_defaults.values:  # read again under them (a line's min_tokens against the model's max_tokens)
        jobs = read_prompts(Path(args.prompts), {**BUILT_IN, **model_defaults.values, **flags})
    if model_defaults.max_tokens_cap is not None:  # vLLM's cap (--override-generation-config's max_new_tokens)
        cap = model_defaults.max_tokens_cap
        jobs = [(rid, {**f, "max_tokens": min(f["max_tokens"], cap), "min_tokens": min(f.get("min_tokens", 0), cap)},
                 src, own) for rid, f, src, own in jobs]
    # The model's max_tokens is a default: like the server (and vLLM), it never asks for more than the
    # context leaves; a line's own value or --max-tokens is refused when too long, as before.
    room_default = "max_tokens" not in flags and "max_tokens" in model_defaults.values

    from tessera.common.chat_template import ChatTemplateError, render_chat
    from tessera.common.fileio import atomic_file
    from tessera.common.progress import progress
    from tessera.inference.core.sampling_params import SamplingParams
    from tessera.inference.engine.llm_engine import LLMEngine, RequestRejected
    from tessera.inference.spec_decode.proposers import check_draft_model
    from tessera.inference.spec_decode.stats import format_spec_stats
    from tessera.inference.worker.cuda_graphs import check_cuda_graphs
    from tessera.inference.worker.loader import load_for_serving, resolve_device, resolve_dtype

    check_draft_model(cfg.speculative, args.checkpoint)  # before any weight is read
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    check_cuda_graphs(cfg, device)
    loaded = load_for_serving(args.checkpoint, device, dtype, cfg.quantization, cfg.tensor_parallel,
                              kv_cache_dtype=cfg.kv_cache_dtype, skip_checksum_verify=cfg.skip_checksum_verify,
                              generation_config=cfg.generation_config)
    engine = LLMEngine(loaded, cfg, device, dtype)
    if not args.quiet and model_defaults.applies:
        print(f"tessera-generate: {model_defaults.describe()}")
    try:
        tok = loaded.tokenizer
        results: dict[str, dict[str, Any]] = {}
        for n, (rid, fields, (kind, value), own_max_tokens) in enumerate(jobs):
            if kind == "prompt":
                ids = tok.backend.encode(value, add_special_tokens=True).ids if isinstance(value, str) else value
            else:
                try:
                    ids = tok.encode(render_chat(tok, value))
                except ChatTemplateError as exc:
                    raise UserError(f"{args.prompts}: prompt {rid}: {exc}") from None
            key = f"{n}:{rid}"
            if room_default and not own_max_tokens:
                room = max(1, engine.max_model_len - len(ids))  # a prompt too long is still refused below
                fields = {**fields, "max_tokens": min(fields["max_tokens"], room),
                          "min_tokens": min(fields.get("min_tokens", 0), room)}
            try:
                engine.add_request(key, ids, SamplingParams(**fields))
            except RequestRejected as exc:
                raise UserError(f"{args.prompts}: prompt {rid}: {exc}") from None
            results[key] = {"id": rid, "text": "", "token_ids": [], "logprobs": [] if fields.get("logprobs") is not None else None}

        bar = progress(total=len(jobs), desc="generating", unit="prompt", quiet=args.quiet)

        def collect(out) -> None:
            r = results[out.request_id]
            r["text"] += out.new_text
            r["token_ids"].extend(out.new_token_ids)
            if r["logprobs"] is not None:
                r["logprobs"].extend({"token_id": lp.token_id, "logprob": lp.logprob,
                                      "top": [[t, v] for t, v in lp.top]} for lp in out.new_logprobs)
            if out.finished:
                r.update(finish_reason=out.finish_reason, prompt_tokens=out.num_prompt_tokens,
                         completion_tokens=out.num_output_tokens)
                bar.update(1)

        engine.run_to_completion(collect)
        bar.close()
        with atomic_file(out_path, "w") as f:
            for r in results.values():
                if r["logprobs"] is None:
                    del r["logprobs"]
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
        if not args.quiet:
            print(f"tessera-generate: wrote {len(results)} completions to {out_path}")
            st = engine.stats()
            if cfg.speculative is not None:
                print("tessera-generate: " + format_spec_stats(st.spec_num_drafts, st.spec_num_draft_tokens,
                                                              st.spec_num_accepted_tokens, st.spec_accepted_per_pos))
    finally:
        engine.close()  # stops tensor-parallel workers
    return 0


def entry() -> None:
    run_cli(main)
