"""Tensor-parallel decode steps (worker/tensor_parallel/): with the persistent decode batch
(batch.DecodeBatch) the driver plans each steady decode step's update to the batch and sends only
that; every worker keeps its copy of the batch's block tables and applies it. With async scheduling
(runner.PendingStep) each step is sent with the tokens of the one before while the driver applies
that one. Whatever the steps do (sequences joining and leaving, crossing blocks, preemption, an
abort), every request's output is one process's; a steady step's frame carries no block table."""

from __future__ import annotations

import json

import pytest
from test_async_scheduling import _run, _same

from tessera.inference.worker.tensor_parallel.executor import TensorParallelExecutor

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


@pytest.fixture
def frames(monkeypatch) -> list[dict]:
    """Every step command the driver sends the workers (decoded)."""
    sent: list[dict] = []
    send = TensorParallelExecutor._send

    def watched(self, frame: bytes, reply: bool = False):
        msg = json.loads(frame)
        if msg["t"] in ("decode", "step"):
            sent.append(msg)
        return send(self, frame, reply)

    monkeypatch.setattr(TensorParallelExecutor, "_send", watched)
    return sent


@pytest.mark.parametrize("num_kv_blocks", [200, 24], ids=["roomy", "preempting"])
def test_tp2_decode_steps_sent_as_updates_give_every_request_one_process_output(tiny_ckpt, frames, num_kv_blocks):
    """The async-scheduling workload (test_async_scheduling._run, synchronous here): 14 requests of
    mixed sampling, prompts in chunks beside decodes, blocks of 4 tokens, r4 aborted mid-way; with 24
    blocks some sequences are preempted and readmitted with other block tables."""
    outs, _, preemptions, aborted, _ = _run(tiny_ckpt, False, num_kv_blocks, abort_after=9, tensor_parallel=2)
    reference, _, ref_preemptions, ref_aborted, _ = _run(tiny_ckpt, False, num_kv_blocks, abort_after=9)
    _same(outs, reference)
    assert (preemptions, aborted) == (ref_preemptions, ref_aborted)
    assert (preemptions > 0) == (num_kv_blocks == 24)
    updates = [json.loads(json.dumps(m["u"])) for m in frames if m["t"] == "decode"]
    tokens, starts, fresh, fresh_blocks, src, whole = zip(*updates)
    steady = [i for i, s in enumerate(src) if s is None]
    moved = [i for i, s in enumerate(src) if s is not None and any(r >= 0 and r != j for j, r in enumerate(s))]
    rebuilt = [i for i, s in enumerate(src) if s is not None and set(s) == {-1}]
    assert steady and moved and rebuilt, "steady steps; kept rows moving up when one left; rows written whole"
    assert all(not whole[i] for i in steady)  # a steady step sends no block table
    assert all(len(whole[i]) == src[i].count(-1) for i in range(len(updates)) if src[i] is not None)
    assert any(fresh[i] for i in steady)  # a row entered a new block: its one new entry went
    assert all(len(fresh[i]) == len(fresh_blocks[i]) for i in range(len(updates)))
    assert any(m["t"] == "step" for m in frames)  # prefill chunks still go as their sequences


def test_tp2_a_decode_step_that_fails_on_its_way_is_retried_and_the_workers_batches_catch_up(tiny_ckpt, frames,
                                                                                                monkeypatch):
    """A decode step whose send fails before any worker got it (once): the engine retries each request
    alone, as for any failed step, and the workers' batches, one step behind the driver's plan, catch up:
    a row is kept only when its sequence advanced by one, which a failed step never does."""
    from inference_helpers import make_engine, run_all, token_ids

    from tessera.inference.core.sampling_params import SamplingParams

    forward_decode = TensorParallelExecutor.forward_decode
    calls = []

    def flaky(self, update, device):
        calls.append(len(update.starts))
        if len(calls) == 3:
            raise RuntimeError("injected: the frame never left")
        return forward_decode(self, update, device)

    monkeypatch.setattr(TensorParallelExecutor, "forward_decode", flaky)
    greedy = SamplingParams(max_tokens=9, temperature=0, ignore_eos=True)
    requests = {"a": ([4, 9, 200, 31, 77], greedy), "b": ([17, 300, 2], greedy), "c": ([5] * 11, greedy)}
    outs = {}
    for tp in (2, 1):
        engine = make_engine(tiny_ckpt, tensor_parallel=tp, block_size=4, num_kv_blocks=64, enforce_eager=True)
        try:
            outs[tp] = {rid: token_ids(o) for rid, o in run_all(engine, requests).items()}
        finally:
            engine.close()
    assert outs[2] == outs[1]
    assert calls[2] == 3 and calls[3:6] == [1, 1, 1]  # the failed step, then each request alone
    assert frames[-1]["t"] == "decode"


# ---- async scheduling under tensor parallel (runner.PendingStep) --------------------------------

@pytest.mark.parametrize("num_kv_blocks", [200, 24], ids=["roomy", "preempting"])
def test_tp2_overlapped_steps_give_every_request_the_output_of_one_process_synchronous_steps(tiny_ckpt,
                                                                                             num_kv_blocks):
    """Launched under TP2 (each step sent with the tokens of the one before, sampled on the driver)
    against one process stepping synchronously: the same outputs, seeded sampling, stops, penalties,
    logprobs and preemption included."""
    outs, launched, preemptions, _, steps = _run(tiny_ckpt, True, num_kv_blocks, tensor_parallel=2)
    reference, _, ref_preemptions, _, _ = _run(tiny_ckpt, False, num_kv_blocks)
    _same(outs, reference)
    assert (preemptions > 0) == (ref_preemptions > 0) == (num_kv_blocks == 24)
    assert len(launched) > steps / 2
    # Steps mixing decode rows fed from the step before with prompt chunks went too.
    assert any({j is None for *_, j in plan} == {True, False} for plan in launched)


def test_tp2_overlapped_decode_updates_through_the_workers_padded_decode_forward_give_one_process_outputs(tiny_ckpt):
    """Each worker replays its bucket (`DecodeGraphs.step_bucket`, run uncaptured on CPU) from the
    update it applied; preempting pool: rows rebuilt whole, buckets changing as sequences join and leave."""
    outs, launched, preemptions, _, steps = _run(tiny_ckpt, True, 24, tensor_parallel=2, enforce_eager=False,
                                                 padded_decode=True, cuda_graph_sizes=[1, 2, 4, 8])
    reference, *_ = _run(tiny_ckpt, False, 24)
    _same(outs, reference)
    assert preemptions > 0 and len(launched) > steps / 2


def test_tp2_the_driver_applies_a_step_while_the_workers_run_the_next(tiny_ckpt, monkeypatch):
    """The point of it: while the engine applies a step's tokens (outputs, detokenizing) the next
    step is already on the workers, its rows not read yet; and a request aborted in flight gets
    nothing more while the others finish as one process's do."""
    import test_async_scheduling

    from tessera.inference.engine.output_processor import OutputProcessor

    engines, in_flight = [], []
    make_engine, update = test_async_scheduling.make_engine, OutputProcessor.update

    def tracked(ckpt, **cfg):
        engines.append(make_engine(ckpt, **cfg))
        return engines[-1]

    def watched(self, plan, result):
        in_flight.append(engines[-1].runner.executor.unread)
        return update(self, plan, result)

    monkeypatch.setattr(test_async_scheduling, "make_engine", tracked)
    monkeypatch.setattr(OutputProcessor, "update", watched)
    outs, launched, _, aborted_at, _ = _run(tiny_ckpt, True, 200, abort_after=6, tensor_parallel=2)
    monkeypatch.undo()
    reference, *_ = _run(tiny_ckpt, False, 200, abort_after=aborted_at)
    assert aborted_at > 0
    _same(outs, reference)
    assert outs["r4"] and not outs["r4"][-1][2]  # no end: nothing came after the abort
    assert sum(in_flight) > len(in_flight) / 2, in_flight  # most updates ran beside the workers' next step


def test_a_tp2_server_with_async_scheduling_streams_the_openai_client_what_one_without_it_streams(tiny_ckpt):
    from live_server import streamed_with_and_without_async_scheduling

    bodies = [dict(prompt=[5 + i, 17, 33 + 7 * i], max_tokens=16, **kind)
              for i, kind in enumerate([dict(temperature=0), dict(temperature=0.9, seed=11), dict(temperature=0, stop=["e"]),
                                        dict(temperature=0.8, top_p=0.9, seed=2)])]
    got = streamed_with_and_without_async_scheduling(tiny_ckpt, bodies, tensor_parallel=2)
    assert got[True] == got[False]
    assert all(text for text, _ in got[True])


# ---- async scheduling under tensor parallel with structured output ----------------------------

def test_tp2_overlapped_steps_with_grammar_rows_give_one_process_synchronous_outputs(tiny_ckpt):
    """test_async_structured's workload (JSON, regex, choice grammars beside plain requests, seeded
    sampling, penalties, logprobs) launched under TP2: a grammar row's token is sampled on the driver
    once the step before has advanced its matcher (`PendingStep.finish_sampling`), and the step after
    it is sent with that token."""
    import test_async_structured as structured

    outs, launched, _, _, steps = structured._run(tiny_ckpt, True, tensor_parallel=2)
    reference, *_ = structured._run(tiny_ckpt, False)
    structured._same(outs, reference)
    assert all(v[-1][2] and v[-1][5] is None for v in outs.values())  # every request ended, none failed
    assert sum(seq.matcher is not None and fed for plan in launched for seq, _, fed in plan) > 20
    assert len(launched) > steps / 2


def test_tp2_overlapped_a_mask_that_raises_fails_its_own_request_only(tiny_ckpt):
    import test_async_structured as structured

    outs, *_ = structured._run(tiny_ckpt, True, fail="r4", tensor_parallel=2)
    reference, *_ = structured._run(tiny_ckpt, False, fail="r4")
    structured._same(outs, reference)
    assert {rid for rid, v in outs.items() if v[-1][5] is not None} == {"r4"}


def test_tp2_overlapped_rows_whose_read_fails_fail_their_requests_and_the_pipe_stays_in_step(tiny_ckpt,
                                                                                          monkeypatch):
    """A launched step whose rows came back but could not be taken (injected after its frames were
    read: a device copy that raises) fails its requests once; it is not read a second time, which
    would wait for an answer no command asked for. The engine then serves a new request exactly as
    one process does."""
    from inference_helpers import make_engine, run_all, token_ids

    from tessera.inference.core.sampling_params import SamplingParams
    from tessera.inference.worker.tensor_parallel import executor

    receive, recv, reads = executor.receive_rows, TensorParallelExecutor._recv, []

    def failing(*args, **kwargs):
        rows = receive(*args, **kwargs)
        reads.append(1)
        if len(reads) == 4:
            raise RuntimeError("injected: the rows could not be copied to the device")
        return rows

    def bounded(self, rank, timeout=None):  # a read that nothing answers fails the test instead of hanging it
        return recv(self, rank, 120.0 if timeout is None else timeout)

    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    requests = {"a": ([4, 9, 200, 31, 77], greedy), "b": ([17, 300, 2], greedy), "c": ([5] * 11, greedy)}
    later = {"d": ([8, 41, 3, 99], greedy)}
    engine = make_engine(tiny_ckpt, tensor_parallel=2, block_size=4, num_kv_blocks=64, enforce_eager=True,
                         async_scheduling=True)
    try:
        monkeypatch.setattr(executor, "receive_rows", failing)
        monkeypatch.setattr(TensorParallelExecutor, "_recv", bounded)
        outs = run_all(engine, requests)
        monkeypatch.setattr(executor, "receive_rows", receive)
        after = {rid: token_ids(o) for rid, o in run_all(engine, later).items()}
    finally:
        engine.close()
    reference_engine = make_engine(tiny_ckpt, block_size=4, num_kv_blocks=64, enforce_eager=True)
    reference = {rid: token_ids(o) for rid, o in run_all(reference_engine, {**requests, **later}).items()}
    assert len(reads) >= 4
    errors = {rid: v[-1].error for rid, v in outs.items()}
    assert set(errors.values()) == {"internal error while sampling this request"}, errors  # the step's rows
    assert after == {"d": reference["d"]}
