"""Async scheduling (`--async-scheduling`): each steady decode step is planned and launched while
the one before it runs, its input tokens read from that step's sampled tensor, and applied one
step later. Whatever it overlaps, every request's output is the one synchronous steps give (greedy
and seeded sampling, stops that end a sequence with a row already launched, preemption, aborts in
flight), every block comes back, and the server answers the `openai` client as without it."""

from __future__ import annotations

import pytest
import torch
from inference_helpers import generate_usage_error, make_engine
from live_server import streamed_with_and_without_async_scheduling

from tessera.inference.core.sampling_params import SamplingParams

# Greedy and seeded draws, logprobs (computed on the device), stop strings (a sequence stops with its
# next row launched), penalties, logit_bias and min_tokens (which read the token in flight on the
# device); and prompt logprobs, whose steps are planned after the step before is applied.
KINDS = [dict(temperature=0, stop=["e"]), dict(temperature=0.9, seed=5, stop=["a", "o"], logprobs=2),
         dict(temperature=1.0, seed=7, repetition_penalty=1.3), dict(temperature=0.7, top_k=20, top_p=0.9, seed=9,
                                                                     stop=["t"], frequency_penalty=0.8),
         dict(temperature=0, ignore_eos=True, logprobs=0, presence_penalty=1.5, logit_bias={7: 3.0, 300: -2.0}),
         dict(temperature=0, min_tokens=5, stop_token_ids=list(range(0, 512, 3)))]
LATE = [dict(temperature=0, prompt_logprobs=True), dict(temperature=0.8, seed=3, presence_penalty=0.5, prompt_logprobs=True)]


def _same(outs: dict[str, list], reference: dict[str, list]) -> None:
    """The same outputs: ids, text and ends exactly; logprobs to fp32 rounding. A stop leaves one more
    row in the launched step than in the synchronous one, and a batch of another size rounds the
    GEMMs otherwise (measured here: at most 1.2e-6 apart)."""
    assert [[o[:-1] for o in v] for v in outs.values()] == [[o[:-1] for o in v] for v in reference.values()]
    for got, want in zip(outs.values(), reference.values()):
        for a, b in zip(got, want):
            assert [(lp[0], *(t for t, _ in lp[2:])) for lp in a[-1]] == [(lp[0], *(t for t, _ in lp[2:])) for lp in b[-1]]
            assert [lp[1] for lp in a[-1]] == pytest.approx([lp[1] for lp in b[-1]], abs=1e-5)


def _engine(ckpt, device: str, **cfg):
    if device == "cpu":
        return make_engine(ckpt, **cfg)
    from tessera.inference.config import EngineConfig
    from tessera.inference.engine.llm_engine import LLMEngine
    from tessera.inference.worker.loader import load_for_serving

    dev = torch.device(device)
    return LLMEngine(load_for_serving(ckpt, dev, torch.float32), EngineConfig(device=device, **cfg), dev, torch.float32)


def _run(ckpt, overlap: bool, num_kv_blocks: int, abort_after: int | None = None, device: str = "cpu", **cfg):
    """Requests with the KINDS above (and two of LATE among the later ones) through an engine with
    a 16-token step budget (prompts in chunks beside decodes); returns per request its outputs'
    fields, the plans launched ahead as rows (sequence, start, tokens, index of its input token in
    the step before or None), the preemption count, the step r4 was aborted after, and the steps.
    `abort_after`: r4 is aborted after that many steps (overlapped: once a row of it is in flight)."""
    engine = _engine(ckpt, device, block_size=4, num_kv_blocks=num_kv_blocks, max_model_len=64, max_num_seqs=8,
                     max_num_batched_tokens=16, async_scheduling=overlap, **({"enforce_eager": True} | cfg))
    launched: list[list] = []
    if overlap:
        launch = engine.runner.launch

        def spy(plan, previous=None, rows=None):
            launched.append([(s.seq, s.start, s.num_new, j) for s, j in zip(plan.scheduled, rows or [None] * 99)])
            return launch(plan, previous, rows)
        engine.runner.launch = spy
    rng = torch.Generator().manual_seed(4)
    outs: dict[str, list] = {}
    for i in range(14):
        length = 30 if i == 0 else int(torch.randint(3, 14, (1,), generator=rng))  # r0: alone, two chunks first
        prompt = torch.randint(1, 500, (length,), generator=rng).tolist()
        kind = LATE[i % 2] if i in (9, 12) else KINDS[(i + 4) % len(KINDS)]  # r0: greedy, to its length
        outs[f"r{i}"] = []
        max_tokens = 4 if kind in LATE else 12 + 4 * (i % 5)  # a late one holds the overlap back while it runs
        engine.add_request(f"r{i}", prompt, SamplingParams(**{"max_tokens": max_tokens, **kind}))
    steps = aborted_at = 0
    try:
        while engine.has_unfinished():
            for o in engine.step():
                outs[o.request_id].append((o.new_token_ids, o.new_text, o.finished, o.finish_reason, o.num_output_tokens,
                                           [(lp.token_id, lp.logprob, *lp.top) for lp in o.new_logprobs]))
            steps += 1
            # Overlapped: the first step from `abort_after` on that leaves a row of r4 in flight.
            if (abort_after is not None and steps >= abort_after and "r4" in engine.requests
                    and (not overlap or engine._inflight is not None
                         and any(s.seq.request_id == "r4" for s in engine._inflight.plan.scheduled))):
                assert engine.abort("r4")
                abort_after = None
                aborted_at = steps
        assert engine.blocks.num_used == 0  # every block came back, the aborted request's included
    finally:
        engine.close()  # tensor-parallel workers (nothing on one device)
    return outs, launched, engine.scheduler.num_preemptions, aborted_at, steps


@pytest.mark.parametrize("num_kv_blocks", [200, 24], ids=["roomy", "preempting"])
def test_overlapped_steps_give_every_request_the_output_of_synchronous_steps(tiny_ckpt, num_kv_blocks):
    outs, launched, preemptions, _, steps = _run(tiny_ckpt, True, num_kv_blocks)
    reference, _, ref_preemptions, _, _ = _run(tiny_ckpt, False, num_kv_blocks)
    _same(outs, reference)  # seeded sampling included
    # Without a free block a step is planned after the one in flight, which may preempt.
    assert (preemptions > 0) == (ref_preemptions > 0) == (num_kv_blocks == 24)
    rows = [row for plan in launched for row in plan]
    assert len(launched) > steps / 2  # the others: the first, and those with a LATE request
    # Launched: decode rows fed from the step in flight beside admitted prompts and next chunks ...
    assert any({j is None for *_, j in plan} == {True, False} for plan in launched)
    assert any(j is None and start > 0 and n > 1 for seq, start, n, j in rows)
    # ... and rows whose sequence a stop in the step before had ended: computed, then dropped.
    assert any(j is not None and start >= seq.num_tokens - 1 for seq, start, n, j in rows)


def test_penalties_logit_bias_and_min_tokens_count_the_token_in_flight(tiny_ckpt):
    """Each setting changes what a greedy request generates (so a token left out of it would show),
    and overlapped steps, which give it the token in flight on the device, generate what
    synchronous ones do."""
    settings = [dict(frequency_penalty=2.0), dict(presence_penalty=2.0), dict(repetition_penalty=2.0),
                dict(min_tokens=8, stop_token_ids=list(range(1, 512, 2))), dict(logit_bias={5: 4.0, 9: 3.0})]
    # Prompts after which this checkpoint repeats a token greedily (found by search): a penalty that
    # missed the token in flight would let it come once more.
    # min_tokens: after [250, 3] the first unmasked token is a stop id, so a mask kept one token too long shows.
    prompts = [[302, 261], [69, 474, 42, 262], [280, 12, 242], [250, 3], [440, 254]]

    def run(overlap: bool, with_settings: bool) -> list[list[int]]:
        engine = make_engine(tiny_ckpt, block_size=4, num_kv_blocks=100, max_num_seqs=8, enforce_eager=True,
                             async_scheduling=overlap)
        launch, fed = engine.runner.launch, []
        engine.runner.launch = lambda plan, previous=None, rows=None: fed.append(previous is not None) or launch(
            plan, previous, rows)
        for i, (prompt, extra) in enumerate(zip(prompts, settings)):
            engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True,
                                                               **(extra if with_settings else {})))
        outs = {f"r{i}": [] for i in range(len(prompts))}
        engine.run_to_completion(lambda o: outs[o.request_id].extend(o.new_token_ids))
        assert not overlap or sum(fed) >= 10
        return list(outs.values())

    plain, synchronous = run(False, False), run(False, True)
    assert all(a != b for a, b in zip(plain, synchronous))
    assert run(True, True) == synchronous


def test_overlapped_steps_through_the_padded_decode_forward_give_the_synchronous_outputs(tiny_ckpt):
    """The forward CUDA graphs replay, run uncaptured on CPU: its inputs take the launched tokens."""
    graphs = dict(enforce_eager=False, padded_decode=True, cuda_graph_sizes=[1, 2, 4, 8])
    outs, launched, _, _, steps = _run(tiny_ckpt, True, 200, **graphs)
    reference, *_ = _run(tiny_ckpt, False, 200)
    _same(outs, reference)
    assert len(launched) > steps / 2  # the others: the first, and those with a LATE request


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_overlapped_steps_replaying_captured_graphs_give_the_synchronous_eager_outputs(tiny_ckpt):
    """The device path: tokens sampled on the GPU feed the next captured graph's static input
    buffer, host inputs go through pinned memory, each step's tokens come back behind an event."""
    outs, launched, _, _, steps = _run(tiny_ckpt, True, 200, device="cuda", enforce_eager=False,
                                cuda_graph_sizes=[1, 2, 4, 8])
    reference, *_ = _run(tiny_ckpt, False, 200, device="cuda")
    _same(outs, reference)
    assert len(launched) > steps / 2  # the others: the first, and those with a LATE request


def test_a_request_aborted_while_its_next_step_is_in_flight_gets_nothing_more_and_the_others_finish_as_before(
        tiny_ckpt):
    outs, launched, _, aborted_at, _ = _run(tiny_ckpt, True, 200, abort_after=6)
    reference, *_ = _run(tiny_ckpt, False, 200, abort_after=aborted_at)
    assert aborted_at > 0
    _same(outs, reference)
    assert outs["r4"] and not outs["r4"][-1][2]  # no end: nothing came after the abort
    assert any(seq.request_id == "r4" and start == seq.num_tokens - 1 for plan in launched for seq, start, *_ in plan)


def test_async_scheduling_is_refused_in_one_line_with_speculation(tiny_ckpt, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "x"}\n')
    line = generate_usage_error(["--checkpoint", tiny_ckpt, "--prompts", prompts, "--output", tmp_path / "o.jsonl",
                                 "--async-scheduling", "--speculative-config",
                                 '{"method": "ngram", "num_speculative_tokens": 2}'], capsys)
    assert "async-scheduling" in line and "speculative decoding" in line


def test_which_kinds_build_decode_steps_from_the_persistent_batch_that_async_scheduling_feeds():
    """The engine refuses --async-scheduling for a kind whose runner builds its decode steps otherwise
    (`keeps_decode_batch`): hybrid states, an encoder, an encoder-decoder; the latent runner (MLA)
    and the vision-language one take theirs from the batch, as the decoder does."""
    from tessera.inference.worker.kinds import RUNNERS

    keeps = {kind: runner.keeps_decode_batch() for kind, runner in RUNNERS.items()}
    assert keeps == {"decoder": True, "vision_language": True, "latent": True, "hybrid": False, "pooling": False,
                     "encoder_decoder": False}


def test_a_server_with_async_scheduling_streams_the_openai_client_what_one_without_it_streams(tiny_ckpt):

    bodies = [dict(prompt=[5 + i, 17, 33 + 7 * i], max_tokens=24, **kind)
              for i, kind in enumerate([dict(temperature=0), dict(temperature=0.9, seed=11), dict(temperature=0, stop=["e"]),
                                        dict(temperature=0.8, top_p=0.9, seed=2), dict(temperature=0), dict(temperature=1.0, seed=4)])]

    got = streamed_with_and_without_async_scheduling(tiny_ckpt, bodies)
    assert got[True] == got[False]
    assert all(text for text, _ in got[True])


def test_choosing_a_launched_steps_tokens_reads_nothing_back_from_the_device(tiny_ckpt):
    """A read back while choosing the tokens of a launched step makes the host wait for that step's
    forward on CUDA, so nothing overlaps it: seen on CPU as the ops that read back (`.item()`, and
    torch.multinomial, whose CUDA kernel checks its input with two)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from tessera.inference.sample.sampler import Sampler

    class ReadBacks(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.multinomial.default,
                        torch.ops.aten.nonzero.default):
                ReadBacks.count += 1
            return func(*args, **(kwargs or {}))

    engine = make_engine(tiny_ckpt, block_size=4, num_kv_blocks=64, max_model_len=64, async_scheduling=True)
    for i, kind in enumerate([dict(temperature=0.9, seed=1), dict(temperature=0.7, top_k=5, top_p=0.9, min_p=0.01, seed=2),
                              dict(temperature=0, logprobs=2), dict(temperature=0.8, seed=4, repetition_penalty=1.2,
                                                                    frequency_penalty=0.5, presence_penalty=0.3),
                              dict(temperature=0, min_tokens=4, stop_token_ids=[7, 8], logit_bias={3: 2.0})]):
        engine.add_request(f"r{i}", [3 + i, 9, 27], SamplingParams(max_tokens=8, **kind))
    engine.step()
    seqs = list(engine.scheduler.running)
    logits = torch.randn(len(seqs), engine.loaded.config.vocab_size, generator=torch.Generator().manual_seed(0))
    with ReadBacks():  # each row's newest token in flight, as a launched step gives them
        tokens, logprobs = Sampler.sample_on_device(seqs, logits, [torch.tensor([11])] * len(seqs), lambda t: t)
    assert len(seqs) == 5 and tokens.shape == (5,) and logprobs is not None
    assert ReadBacks.count == 0


def test_a_token_drawn_on_the_device_is_the_one_the_synchronous_draw_takes_from_the_same_generator():
    from tessera.inference.sample.sampler import draw, draw_on_device

    rows = torch.randn(40, 300, generator=torch.Generator().manual_seed(3)) * 4
    rows[::3, ::2] = float("-inf")  # filtered tokens
    rows[5] = float("-inf")  # nothing left: the argmax's point mass
    rows[7, 11] = float("nan")
    for seed, row in enumerate(rows):
        ahead, now = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
        assert int(draw_on_device(row, ahead)) == draw(row, now)[0]
        assert torch.equal(ahead.get_state(), now.get_state())  # the request's next draws stay the same too
