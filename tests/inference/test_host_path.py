"""The decode step's host path, cut for issue #34 item 5, gives what it gave before: a stream that
fell behind the engine merges its queued outputs into one (same ids, text, logprobs, end), and the
CPU decode groups built from host-sorted lengths equal the argsort grouping; the persistent decode
batch (kept block tables and decode groups) gives what inputs rebuilt every step gave."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from tessera.inference.core.sequence import TokenLogprob
from tessera.inference.engine.frontend import RequestFailed, RequestHandle
from tessera.inference.engine.output_processor import RequestOutput
from tessera.inference.entrypoints.server.base import ServerBase
from tessera.inference.worker.decode_attention import (
    DECODE_GROUP,
    SteadySplit,
    decode_group,
    decode_groups,
    decode_split,
)


def _out(rid: str, ids: list[int], text: str, finished: bool = False, n_out: int = 0,
         prompt_lps: list | None = None) -> RequestOutput:
    return RequestOutput(request_id=rid, new_token_ids=ids, new_text=text,
                         new_logprobs=[TokenLogprob(t, -0.5 * t) for t in ids], finished=finished,
                         finish_reason="length" if finished else None, num_prompt_tokens=3, num_output_tokens=n_out,
                         num_cached_tokens=0, prompt_logprobs=prompt_lps)


class _Connected:
    async def is_disconnected(self) -> bool:
        return False


class _Engine:
    def __init__(self):
        self.aborted: list[str] = []

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def _drain(ready: list[tuple[int, object]], n: int) -> tuple[list[tuple[int, object]], list[str]]:
    """What ServerBase._merged yields for `n` requests whose items were all queued before it looked."""
    engine = _Engine()

    async def run():
        queue: asyncio.Queue = asyncio.Queue()
        for item in ready:
            queue.put_nowait(item)
        handles = [RequestHandle(engine, f"r{i}", queue) for i in range(n)]
        got = []
        try:
            async for i, out in ServerBase._merged(None, (handles, queue), _Connected()):  # type: ignore[arg-type]
                got.append((i, out))
        except RequestFailed as exc:
            got.append((-1, exc))
        return got
    got = asyncio.run(run())
    return got, engine.aborted


def test_outputs_queued_behind_a_stream_come_out_as_one_with_the_same_ids_text_logprobs_and_end():
    prompt_lps = [None, TokenLogprob(7, -1.0)]
    ready = [(0, _out("r0", [1], "a", n_out=1, prompt_lps=prompt_lps)), (1, _out("r1", [4], "x", n_out=1)),
             (0, _out("r0", [2], "b", n_out=2)), (0, _out("r0", [3], "c", finished=True, n_out=3)),
             (1, _out("r1", [5], "y", finished=True, n_out=2))]
    got, aborted = _drain(ready, 2)
    assert [i for i, _ in got] == [0, 1] and aborted == []
    first, second = got[0][1], got[1][1]
    assert (first.new_token_ids, first.new_text, first.finished, first.finish_reason, first.num_output_tokens) == (
        [1, 2, 3], "abc", True, "length", 3)
    assert [lp.token_id for lp in first.new_logprobs] == [1, 2, 3] and first.prompt_logprobs == prompt_lps
    assert (second.new_token_ids, second.new_text, second.finished) == ([4, 5], "xy", True)


def test_a_failure_queued_behind_outputs_keeps_its_place_and_nothing_merges_across_it():
    failure = RequestFailed("internal error while sampling this request")
    ready = [(0, _out("r0", [1], "a", n_out=1)), (1, _out("r1", [4], "x", n_out=1)), (1, failure),
             (0, _out("r0", [2], "b", finished=True, n_out=2))]
    got, aborted = _drain(ready, 2)
    # The stream raises at the failure: what was queued before it went out first, merged per request;
    # the other request is aborted (the failure ends the whole reply).
    assert [(i, getattr(o, "new_text", None)) for i, o in got] == [(0, "a"), (1, "x"), (-1, None)]
    assert got[-1][1] is failure and aborted == ["r0", "r1"]


def test_decode_groups_from_host_sorted_lengths_equal_the_argsort_grouping():
    g = torch.Generator().manual_seed(3)
    block_size, n = 4, 3 * DECODE_GROUP + 5
    lens = torch.randint(1, 40, (n,), generator=g, dtype=torch.int32)
    lens[5] = lens[9] = lens[17] = lens[2]  # ties keep batch order, as a stable argsort does
    tables = torch.randint(0, 500, (n, 10), generator=g, dtype=torch.int32)
    rows = torch.arange(n * 2).view(n, 2)
    got = decode_groups(tables, lens, block_size, rows, 2)
    order = torch.argsort(lens, stable=True)
    want = [decode_group(rows[idx], tables[idx], lens[idx], block_size, 2) for idx in order.split(DECODE_GROUP)]
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert (a.width, a.num_q, a.block_size) == (b.width, b.num_q, b.block_size)
        assert torch.equal(a.rows, b.rows) and torch.equal(a.blocks, b.blocks) and torch.equal(a.seq_lens, b.seq_lens)


@pytest.mark.parametrize("n", [5, 3 * DECODE_GROUP + 5])
def test_the_kept_decode_grouping_equals_a_fresh_one_step_after_step(n):
    """SteadySplit, advanced step by step as sequences grow and enter new blocks, gives the groups,
    row order and masks that decode_split builds from scratch each step."""
    g = torch.Generator().manual_seed(5)
    block_size = 4
    lens = torch.randint(1, 30, (n,), generator=g).tolist()
    lens[1] = lens[3]  # a tie keeps batch order
    tables = np.zeros((n + 3, 40), dtype=np.int32)  # wider and taller than the step's, as DecodeBatch's
    tables[:n] = torch.randint(0, 500, (n, 40), generator=g, dtype=torch.int32).numpy()
    kept = SteadySplit(lens, tables, block_size)
    for step in range(10):
        if step:
            lens = [x + 1 for x in lens]
            fresh = [i for i, x in enumerate(lens) if (x - 1) % block_size == 0]
            for i in fresh:  # the new block's entry, written as DecodeBatch writes it
                tables[i, (lens[i] - 1) // block_size] = 1000 + 10 * step + i
            got = kept.step(fresh, tables)
        else:
            got = kept.split
        want = decode_split([1] * n, list(range(n + 1)), torch.from_numpy(tables[:n].copy()),
                            torch.tensor(lens, dtype=torch.int32), block_size)
        for a, b in ((got.order, want.order), (got.inverse, want.inverse)):
            assert (a is None and b is None) or torch.equal(a, b)
        assert len(got.decode_groups) == len(want.decode_groups)
        for a, b in zip(got.decode_groups, want.decode_groups):
            assert (a.width, a.num_q) == (b.width, b.num_q)
            assert torch.equal(a.rows, b.rows) and torch.equal(a.blocks, b.blocks)
            assert torch.equal(a.seq_lens, b.seq_lens)
            assert torch.equal(a.mask(None, 2, torch.float32), b.mask(None, 2, torch.float32))


def _decode_mix(tiny_ckpt, reference: bool):
    """A mixed workload through an engine whose pool is short enough to preempt, with more requests
    than sequence slots (finishes and joins), 4-token blocks (rows enter new blocks often) and more
    than DECODE_GROUP running (sorted decode groups). `reference`: every plan marked not single-token,
    so each step takes `prepare` and the general output update (the path before the persistent batch).
    Returns per request its outputs' fields, and (single-token steps, `prepare` calls, preemptions)."""
    from inference_helpers import make_engine

    from tessera.inference.core.sampling_params import SamplingParams

    engine = make_engine(tiny_ckpt, block_size=4, num_kv_blocks=40, max_model_len=64, max_num_seqs=12,
                         max_num_batched_tokens=64, enforce_eager=True)
    counts = {"single": 0, "prepare": 0}
    schedule, prepare = engine.scheduler.schedule, engine.runner.prepare

    def counted_schedule():
        plan = schedule()
        if reference:
            plan.single_token = False
        counts["single"] += plan.single_token
        return plan

    def counted_prepare(*a):
        counts["prepare"] += 1
        return prepare(*a)

    engine.scheduler.schedule, engine.runner.prepare = counted_schedule, counted_prepare
    rng = torch.Generator().manual_seed(3)
    kinds = [dict(temperature=0), dict(temperature=0.9, seed=5), dict(temperature=0, logprobs=2),
             dict(temperature=0, stop=["e"]), dict(temperature=0.7, top_k=20, seed=9)]
    outs: dict[str, list] = {}
    for i in range(20):
        prompt = torch.randint(1, 500, (int(torch.randint(3, 14, (1,), generator=rng)),), generator=rng).tolist()
        outs[f"r{i}"] = []
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=6 + 3 * (i % 7), **kinds[i % len(kinds)]))
    engine.run_to_completion(lambda o: outs[o.request_id].append(
        (o.new_token_ids, o.new_text, [(lp.token_id, lp.logprob, lp.top) for lp in o.new_logprobs], o.finished,
         o.finish_reason, o.num_output_tokens, o.num_cached_tokens)))
    return outs, (counts["single"], counts["prepare"], engine.scheduler.num_preemptions)


def test_steady_decode_steps_keep_their_inputs_across_steps_and_give_what_the_rebuilt_inputs_gave(tiny_ckpt):
    outs, (single, prepared, preemptions) = _decode_mix(tiny_ckpt, reference=False)
    reference, (_, ref_prepared, ref_preemptions) = _decode_mix(tiny_ckpt, reference=True)
    assert outs == reference  # ids, text, logprobs, ends: identical, seeded sampling included
    assert preemptions == ref_preemptions > 0 and single > 10
    # Only the steps that were not single-token (prefills, a step after a join) packed inputs from lists.
    assert prepared == ref_prepared - single


def _old_event(chunk: dict) -> str:
    """An SSE event as the server wrote every chunk before StreamChunks."""
    import json

    return f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"


def test_stream_chunk_templates_write_the_bytes_a_full_json_encode_wrote():
    from tessera.inference.entrypoints.server.base import StreamChunks

    texts = ["", " hello", 'quote " and \\ backslash', "tab\tnew\nline\x00\x1f", "ünïcödé ✓ 🙂", "</script>\u2028"]
    for usage in (False, True):
        for model in ("tiny", 'mödel "x"'):
            head = {"id": "cmpl-abc", "object": "text_completion", "created": 1764350000, "model": model}
            extra = {"usage": None} if usage else {}
            chunks = StreamChunks("cmpl-abc", "text_completion", 1764350000, model, usage)
            chat = StreamChunks("cmpl-abc", "chat.completion.chunk", 1764350000, model, usage)
            for text in texts:
                for reason in (None, "stop", "length", "tool_calls"):
                    choice = {"index": 3, "text": text, "logprobs": None, "finish_reason": reason}
                    assert chunks.text(3, text, reason) == _old_event({**head, "choices": [choice], **extra})
                    delta = {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": reason}
                    want = _old_event({**head, "object": "chat.completion.chunk", "choices": [delta], **extra})
                    assert chat.content(0, text, reason) == want
                    tool = {"index": 1, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": text}}]},
                            "logprobs": {"content": [{"token": text, "logprob": -0.25, "bytes": [1, 2]}]},
                            "finish_reason": reason}
                    assert chunks.event(tool) == _old_event({**head, "choices": [tool], **extra})
