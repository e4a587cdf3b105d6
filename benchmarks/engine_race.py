"""Engines of tessera-serve on the same weights and prompts, timed in turns: greedy, ignore_eos,
every prompt batched together through `LLMEngine.run_to_completion`; the engines alternate which
runs first each round (load from other jobs hits each alike), and those that must agree (a
speculative engine and the plain one) are checked token for token every round. Used by
benchmarks/speculative.py and deepseek_serving.py."""

from __future__ import annotations

import sys
import time


def run_engine(engine, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
    """Seconds to serve every prompt to completion, and each prompt's output tokens."""
    from tessera.inference.core.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outs: dict[str, list[int]] = {}
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{i}", ids, params)
        outs[f"r{i}"] = []
    start = time.perf_counter()
    engine.run_to_completion(lambda o: outs[o.request_id].extend(o.new_token_ids))
    return time.perf_counter() - start, [outs[f"r{i}"] for i in range(len(prompts))]


class OutputsDiffer(Exception):
    pass


def race(engines: dict, prompts: list[list[int]], max_tokens: int, rounds: int,
         same: tuple[str, str] | None = None) -> tuple[dict[str, list[float]], dict[str, list[list[int]]]]:
    """Each engine's seconds per round and its outputs of the last round. `same`: two engines whose
    outputs must be equal; OutputsDiffer (naming them) the first round they are not."""
    secs: dict[str, list[float]] = {name: [] for name in engines}
    outputs: dict[str, list[list[int]]] = {}
    for r in range(rounds):
        for name in (list(engines) if r % 2 == 0 else list(reversed(engines))):
            took, outputs[name] = run_engine(engines[name], prompts, max_tokens)
            secs[name].append(took)
        if same is not None and same[0] in engines and same[1] in engines and outputs[same[0]] != outputs[same[1]]:
            raise OutputsDiffer(f"outputs differ between the {same[0]} and the {same[1]} engine")
    return secs, outputs


def checked_race(program: str, engines: dict, prompts: list[list[int]], max_tokens: int, rounds: int,
                 same: tuple[str, str]) -> tuple[dict[str, list[float]], dict[str, list[list[int]]]] | None:
    """`race`, with engines that must agree: None after saying on stderr, in one line headed by
    `program`, which two differed (the benchmark then exits 1)."""
    try:
        return race(engines, prompts, max_tokens, rounds, same)
    except OutputsDiffer as e:
        print(f"{program}: {e}", file=sys.stderr)
        return None


def spec_summary(engine) -> str:
    """vLLM's speculative-decoding figures of `engine`'s run so far (acceptance rate, mean length,
    per position)."""
    from tessera.inference.spec_decode.stats import format_spec_stats

    st = engine.stats()
    return format_spec_stats(st.spec_num_drafts, st.spec_num_draft_tokens, st.spec_num_accepted_tokens,
                             st.spec_accepted_per_pos)
