"""The messages between the HTTP process and the engine process, as JSON over a byte pipe.

Pickle-free on purpose: a pickle stream can run code when loaded, and nothing read from a pipe
should be able to do that, even from our own child. Frames are
`multiprocessing.connection.Connection.send_bytes` / `recv_bytes` (length-prefixed), holding one
UTF-8 JSON object each; only plain ids, numbers, strings and lists cross (the stats hold one list: speculative decoding's
accepted tokens per draft position).

HTTP process -> engine:  {"t": "add", "id", "prompt", "params"} | {"t": "abort", "ids"} | {"t": "stop"}
                         (the first frame is {"t": "init", "checkpoint", "engine", "threads"})
engine -> HTTP process:  {"t": "ready", ...model facts} | {"t": "error", "user": bool, "message"}
                         | {"t": "step", "outs": [...], "stats": {...}, "adds_seen"} | {"t": "failed", "message"}

With several HTTP processes (one pipe each; init and ready on the first), a pipe's "step" holds only
the outputs of the requests it added, and "adds_seen" counts its own adds; "stop" ends that pipe.
"""

from __future__ import annotations

import json
from typing import Any

from tessera.inference.core.sequence import TokenLogprob
from tessera.inference.engine.llm_engine import EngineStats, RequestOutput


def encode(msg: dict[str, Any]) -> bytes:
    return json.dumps(msg, separators=(",", ":")).encode()


def decode(frame: bytes) -> dict[str, Any]:
    msg = json.loads(frame)
    if not isinstance(msg, dict) or not isinstance(msg.get("t"), str):
        raise ValueError("engine pipe: a frame is not a message object")
    return msg


def _lp_to_wire(lp: TokenLogprob | None) -> list | None:
    return None if lp is None else [lp.token_id, lp.logprob, [list(t) for t in lp.top]]


def _lp_from_wire(x: list | None) -> TokenLogprob | None:
    if x is None:
        return None
    return TokenLogprob(token_id=int(x[0]), logprob=float(x[1]), top=[(int(t), float(v)) for t, v in x[2]])


def output_to_wire(out: RequestOutput) -> list:
    return [out.request_id, out.new_token_ids, out.new_text, [_lp_to_wire(lp) for lp in out.new_logprobs],
            out.finished, out.finish_reason, out.num_prompt_tokens, out.num_output_tokens, out.num_cached_tokens,
            None if out.prompt_logprobs is None else [_lp_to_wire(lp) for lp in out.prompt_logprobs], out.error,
            out.timings, out.client_error, out.embedding]


def output_from_wire(x: list, now: float) -> RequestOutput:
    (rid, ids, text, lps, finished, reason, n_prompt, n_out, n_cached, prompt_lps, error, timings, client_error,
     embedding) = x
    return RequestOutput(  # ids and lps are fresh lists from the frame's JSON: nothing to copy
        request_id=rid, new_token_ids=ids, new_text=text,
        new_logprobs=[_lp_from_wire(lp) for lp in lps] if lps else [],  # type: ignore[misc]
        finished=bool(finished), finish_reason=reason, num_prompt_tokens=n_prompt, num_output_tokens=n_out,
        num_cached_tokens=n_cached,
        prompt_logprobs=None if prompt_lps is None else [_lp_from_wire(lp) for lp in prompt_lps], time=now,
        error=None if error is None else str(error), client_error=bool(client_error),
        timings=None if timings is None else {str(k): float(v) for k, v in timings.items()},
        embedding=None if embedding is None else [float(v) for v in embedding],
    )


def stats_to_wire(stats: EngineStats) -> dict[str, int | list[int]]:
    return dict(vars(stats))  # flat ints and one list of ints: no deep copy (asdict's) needed


def stats_from_wire(x: dict[str, int | list[int]]) -> EngineStats:
    return EngineStats(**{k: [int(a) for a in v] if isinstance(v, list) else int(v) for k, v in x.items()})
