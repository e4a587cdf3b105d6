"""The decode step's host path, cut for issue #34 item 5, gives what it gave before: a stream that
fell behind the engine merges its queued outputs into one (same ids, text, logprobs, end), and the
CPU decode groups built from host-sorted lengths equal the argsort grouping."""

from __future__ import annotations

import asyncio

import torch

from tessera.inference.core.sequence import TokenLogprob
from tessera.inference.engine.frontend import RequestFailed, RequestHandle
from tessera.inference.engine.output_processor import RequestOutput
from tessera.inference.entrypoints.server.base import ServerBase
from tessera.inference.worker.decode_attention import DECODE_GROUP, decode_group, decode_groups


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
