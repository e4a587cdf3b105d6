"""Async scheduling with structured output: a step with grammar rows is launched ahead like any
other, its forward running while the host applies the step before; the grammar rows are sampled
once that update has advanced their matchers (`LaunchedStep.finish_sampling`). Plain and
constrained requests together get exactly the outputs of synchronous steps, steps really are
launched ahead while a grammar runs, and a grammar that ends, an abort in flight or a mask that
raises touch only their own request."""

from __future__ import annotations

import pytest
import torch
from inference_helpers import make_checkpoint, make_engine, tiny_config
from live_server import streamed_with_and_without_async_scheduling

from tessera.inference.core.sampling_params import SamplingParams
from tessera.inference.core.structured_spec import StructuredSpec
from tessera.inference.sample import structured

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "n"], "additionalProperties": False}
JSON = StructuredSpec(kind="json", value=SCHEMA)
REGEX = StructuredSpec(kind="regex", value=r"[a-z]{2,5}-[0-9]{1,3}")
CHOICE = StructuredSpec(kind="choice", value=["yes", "no"])  # ends after a token or two: others run on

# Constrained requests (greedy and seeded, logprobs, penalties and logit_bias beside a grammar) among
# plain ones (a stop string, a seeded draw, logprobs, penalties, min_tokens; structured output refuses it).
KINDS = [dict(temperature=0, structured=JSON), dict(temperature=0.9, seed=5, stop=["a", "o"], logprobs=2),
         dict(temperature=1.0, seed=7, structured=REGEX, logprobs=1), dict(temperature=0, structured=CHOICE),
         dict(temperature=0.8, top_k=30, seed=9, structured=JSON, frequency_penalty=0.8, logit_bias={7: 2.0}),
         dict(temperature=0, stop=["e"], min_tokens=4), dict(temperature=1.0, seed=3, structured=StructuredSpec(kind="json_object")),
         dict(temperature=0.7, seed=11, repetition_penalty=1.3)]


def _engine(ckpt, device: str, **cfg):
    if device == "cpu":
        return make_engine(ckpt, **cfg)
    from tessera.inference.config import EngineConfig
    from tessera.inference.engine.llm_engine import LLMEngine
    from tessera.inference.worker.loader import load_for_serving

    dev = torch.device(device)
    return LLMEngine(load_for_serving(ckpt, dev, torch.float32), EngineConfig(device=device, **cfg), dev, torch.float32)


def _run(ckpt, overlap: bool, num_kv_blocks: int = 200, abort: str | None = None, abort_at: int | None = None,
         fail: str | None = None, device: str = "cpu", **cfg):
    """14 requests of KINDS (8 sequence slots, a 16-token step budget: admissions, chunked prompts)
    through one engine; returns per request its outputs' fields, the launched plans as rows
    (sequence, start, whether it was fed by the step before), the preemptions, the step `abort` was
    aborted after and the step count. `abort`: aborted at step `abort_at` (overlapped: the first step
    from the 6th that has a row of it in flight). `fail`: the mask of that request raises once it
    has 3 output tokens."""
    engine = _engine(ckpt, device, block_size=4, num_kv_blocks=num_kv_blocks, max_model_len=96, max_num_seqs=8,
                     max_num_batched_tokens=16, async_scheduling=overlap, **({"enforce_eager": True} | cfg))
    launched: list[list] = []
    if overlap:
        launch = engine.runner.launch

        def spy(plan, previous=None, rows=None):
            launched.append([(s.seq, s.start, j is not None) for s, j in zip(plan.scheduled, rows or [None] * 99)])
            return launch(plan, previous, rows)
        engine.runner.launch = spy
    rng = torch.Generator().manual_seed(6)
    outs: dict[str, list] = {}
    for i in range(14):
        prompt = torch.randint(1, 500, (int(torch.randint(3, 20, (1,), generator=rng)),), generator=rng).tolist()
        outs[f"r{i}"] = []
        engine.add_request(f"r{i}", prompt, SamplingParams(**{"max_tokens": 10 + 3 * (i % 5), **KINDS[i % len(KINDS)]}))
    if fail is not None:
        target = engine.requests[fail]
        fill = structured._fill

        def failing(pairs, bitmask):
            if len(target.output_ids) >= 3 and any(m is target.matcher for m, _ in pairs):
                raise RuntimeError("injected mask failure")
            return fill(pairs, bitmask)
        structured._fill = failing
    steps = aborted_at = 0
    try:
        while engine.has_unfinished():
            for o in engine.step():
                outs[o.request_id].append((o.new_token_ids, o.new_text, o.finished, o.finish_reason,
                                           o.num_output_tokens, o.error,
                                           [(lp.token_id, lp.logprob, *lp.top) for lp in o.new_logprobs]))
            steps += 1
            inflight = engine._inflight
            if abort is not None and abort in engine.requests and (
                    steps == abort_at if abort_at is not None else steps >= 6 and inflight is not None
                    and any(s.seq.request_id == abort for s in inflight.plan.scheduled)):
                assert engine.abort(abort)
                aborted_at = steps
        assert engine.blocks.num_used == 0  # every block came back
    finally:
        if fail is not None:
            structured._fill = fill
        engine.close()  # tensor-parallel workers (nothing on one device)
    return outs, launched, engine.scheduler.num_preemptions, aborted_at, steps


def _same(outs: dict[str, list], reference: dict[str, list]) -> None:
    """Ids, text, ends and errors exactly; logprobs to fp32 rounding (a batch of another size rounds
    the GEMMs otherwise: test_async_scheduling measured at most 1.2e-6)."""
    assert [[o[:-1] for o in v] for v in outs.values()] == [[o[:-1] for o in v] for v in reference.values()]
    for got, want in zip(outs.values(), reference.values()):
        for a, b in zip(got, want):
            assert [(lp[0], *(t for t, _ in lp[2:])) for lp in a[-1]] == [(lp[0], *(t for t, _ in lp[2:])) for lp in b[-1]]
            assert [lp[1] for lp in a[-1]] == pytest.approx([lp[1] for lp in b[-1]], abs=1e-5)


def _constrained(i: int) -> bool:
    return "structured" in KINDS[i % len(KINDS)]


@pytest.mark.parametrize("num_kv_blocks", [200, 30], ids=["roomy", "preempting"])
def test_plain_and_structured_requests_overlapped_give_the_outputs_of_synchronous_steps(tiny_ckpt, num_kv_blocks):
    outs, launched, preemptions, _, steps = _run(tiny_ckpt, True, num_kv_blocks)
    reference, _, ref_preemptions, _, _ = _run(tiny_ckpt, False, num_kv_blocks)
    _same(outs, reference)
    assert (preemptions > 0) == (ref_preemptions > 0) == (num_kv_blocks == 30)
    finals = {rid: v[-1] for rid, v in outs.items()}
    assert all(f[2] and f[5] is None for f in finals.values())  # every request ended, none failed
    # The choice grammar ended early (its matcher stopped) while other requests went on.
    choice = [f"r{i}" for i in range(14) if KINDS[i % len(KINDS)].get("structured") is CHOICE]
    assert choice and all(finals[r][3] == "stop" and "".join(o[1] for o in outs[r]) in ("yes", "no") for r in choice)
    assert all(len(outs[r]) < steps / 4 for r in choice)
    # Launched ahead while a grammar ran: rows of constrained requests fed by the step in flight ...
    fed = [(seq, start) for plan in launched for seq, start, fed in plan if fed and seq.matcher is not None]
    assert len(fed) > 20
    assert len(launched) > steps / 2
    # ... among them rows whose grammar or stop the step before had ended: computed, masked as
    # allow-all, dropped.
    assert any(start >= seq.num_tokens - 1 for seq, start in fed)


def test_grammar_rows_of_steps_through_the_padded_decode_forward_give_the_synchronous_outputs(tiny_ckpt):
    """The forward CUDA graphs replay, run uncaptured on CPU: the grammar rows' logits are its output
    rows, held until they are sampled."""
    outs, launched, _, _, steps = _run(tiny_ckpt, True, enforce_eager=False, padded_decode=True,
                                       cuda_graph_sizes=[1, 2, 4, 8])
    reference, *_ = _run(tiny_ckpt, False)
    _same(outs, reference)
    assert sum(seq.matcher is not None and fed for plan in launched for seq, _, fed in plan) > 20


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_grammar_rows_sampled_after_the_launch_give_the_synchronous_eager_outputs(tiny_ckpt):
    """The device path: grammar rows masked through pinned copies and sampled into the launched
    step's token tensor, which the next captured graph's input buffer reads."""
    outs, launched, _, _, steps = _run(tiny_ckpt, True, device="cuda", enforce_eager=False,
                                       cuda_graph_sizes=[1, 2, 4, 8])
    reference, *_ = _run(tiny_ckpt, False, device="cuda")
    _same(outs, reference)
    assert len(launched) > steps / 2


def test_a_structured_request_aborted_while_its_step_is_in_flight_gets_nothing_more(tiny_ckpt):
    outs, launched, _, aborted_at, _ = _run(tiny_ckpt, True, abort="r2")
    reference, *_ = _run(tiny_ckpt, False, abort="r2", abort_at=aborted_at)
    assert aborted_at > 0 and _constrained(2)
    _same(outs, reference)
    assert outs["r2"] and not outs["r2"][-1][2]  # no end came after the abort
    assert any(seq.request_id == "r2" and start == seq.num_tokens - 1 for plan in launched for seq, start, _ in plan)


def test_a_mask_that_raises_fails_its_own_request_only(tiny_ckpt):
    """llguidance raising for one matcher (injected) ends that request with an error; the other
    grammars' masks, computed in the same call, are computed again without it."""
    outs, launched, _, _, _ = _run(tiny_ckpt, True, fail="r4")
    reference, *_ = _run(tiny_ckpt, False, fail="r4")
    _same(outs, reference)
    failed = {rid for rid, v in outs.items() if v[-1][5] is not None}
    assert failed == {"r4"} and outs["r4"][-1][3] == "error" and outs["r4"][-1][4] == 3
    healthy, _, _, _, _ = _run(tiny_ckpt, False)
    # The others generate what they generate without the failure (ids and ends; batches of other
    # sizes round logprobs otherwise).
    def ids(runs):
        return {rid: ([t for o in v for t in o[0]], v[-1][3]) for rid, v in runs.items() if rid != "r4"}
    assert ids(outs) == ids(healthy)
    assert sum(seq.matcher is not None and fed for plan in launched for seq, _, fed in plan) > 20


def test_a_server_with_async_scheduling_streams_json_mode_beside_plain_requests_as_one_without_it(tiny_ckpt):

    fmt = {"type": "json_schema", "json_schema": {"name": "item", "schema": SCHEMA}}
    bodies = [dict(prompt=[5 + i, 17, 33 + 7 * i], max_tokens=30, **kind) for i, kind in enumerate(
        [dict(temperature=0), dict(temperature=0.9, seed=11, extra_body={"response_format": fmt}),
         dict(temperature=0, stop=["e"]), dict(temperature=0, extra_body={"guided_choice": ["red", "green"]}),
         dict(temperature=0.8, top_p=0.9, seed=2), dict(temperature=1.0, seed=4, extra_body={"response_format": fmt})])]

    got = streamed_with_and_without_async_scheduling(tiny_ckpt, bodies)
    assert got[True] == got[False]
    assert got[True][3][0] in ("red", "green") and got[True][1][0].startswith("{")


def test_sampling_the_grammar_rows_raising_as_a_whole_fails_those_requests_and_the_others_go_on(tiny_ckpt, monkeypatch):
    """Past one row's failure (e.g. the masked fill itself raising): the step's grammar rows fail
    their requests, its other rows keep their tokens, and the engine goes on."""
    from tessera.inference.sample.sampler import DeferredRows

    finish, calls, victims = DeferredRows.finish, [], []

    def raising(self, chosen):
        calls.append(1)
        if len(calls) == 6:
            victims.extend(self.seqs[r].request_id for r in self.rows if not self.seqs[r].is_finished)
            raise RuntimeError("injected")
        return finish(self, chosen)
    monkeypatch.setattr(DeferredRows, "finish", raising)
    outs, *_ = _run(tiny_ckpt, True)
    monkeypatch.setattr(DeferredRows, "finish", finish)
    healthy, *_ = _run(tiny_ckpt, False)
    assert victims and all(_constrained(int(r[1:])) for r in victims)
    assert {rid for rid, v in outs.items() if v[-1][3] == "error"} == set(victims)
    assert all(outs[r][-1][5] == "internal error while sampling this request" for r in victims)
    asked = [f"r{i}" for i in range(14) if KINDS[i % len(KINDS)].get("logprobs") is not None and f"r{i}" not in victims]
    assert asked and all(sum(len(o[-1]) for o in outs[r]) == outs[r][-1][4] for r in asked)  # none lost a logprob
    ids = {rid: ([t for o in v for t in o[0]], v[-1][3]) for rid, v in outs.items() if rid not in victims}
    assert ids == {rid: ([t for o in v for t in o[0]], v[-1][3]) for rid, v in healthy.items() if rid not in victims}


@pytest.fixture(scope="module")
def padded_ckpt(tmp_path_factory):
    """A vocabulary of 500 in 544 head rows (Megatron's padding; GPT-2's 50257 in 50304 alike): the
    logits are a bitmask word wider than the grammar's vocabulary (16 words against 17)."""
    return make_checkpoint(tmp_path_factory.mktemp("padded"), tiny_config(vocab_size=500, padded_vocab_size=544),
                           tokenizer_vocab=500)


def test_with_a_padded_vocabulary_grammar_rows_overlapped_give_the_synchronous_outputs(padded_ckpt):
    """The launched step's grammar masks are of the logits' width, padding rows disallowed."""
    outs, launched, *_ = _run(padded_ckpt, True)
    reference, *_ = _run(padded_ckpt, False)
    _same(outs, reference)
    assert all(v[-1][2] and v[-1][5] is None for v in outs.values())  # none failed
    assert sum(seq.matcher is not None and fed for plan in launched for seq, _, fed in plan) > 20


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "async"])
def test_with_a_padded_vocabulary_a_mask_that_raises_fails_its_own_request_only(padded_ckpt, overlap):
    """The masks computed again row by row (`bitmask_isolating`) are of the width the matchers fill."""
    outs, *_ = _run(padded_ckpt, overlap, fail="r4")
    assert {rid for rid, v in outs.items() if v[-1][5] is not None} == {"r4"}
