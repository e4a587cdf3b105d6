"""Sampling and stopping, against hand-computed expectations."""

from __future__ import annotations

import math
import random

import pytest
import torch
from inference_helpers import make_engine, run_all, token_ids

from tessera.inference.core.detokenizer import IncrementalDetokenizer
from tessera.inference.core.sampling_params import SamplingParams
from tessera.inference.core.sequence import Sequence
from tessera.inference.sample.sampler import filter_logits, sampling_row


def test_filters():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    kept = lambda x: torch.isfinite(x).nonzero().flatten().tolist()  # noqa: E731
    assert kept(filter_logits(logits, 2, 1.0, 0.0)) == [0, 1]
    assert kept(filter_logits(logits, 0, 0.8, 0.0)) == [0, 1]  # 0.5 + 0.3 reaches 0.8
    assert kept(filter_logits(logits, 0, 0.81, 0.0)) == [0, 1, 2]
    assert kept(filter_logits(logits, 0, 1.0, 0.5)) == [0, 1]  # >= 0.25
    assert kept(filter_logits(logits, 0, 0.01, 0.0)) == [0]


def test_params_validation():
    with pytest.raises(ValueError):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError):
        SamplingParams(max_tokens=2, min_tokens=3)
    with pytest.raises(ValueError):
        SamplingParams(stop=[""])


def test_stop_string_streaming_holdback(tiny_ckpt):
    engine = make_engine(tiny_ckpt, num_kv_blocks=64)
    tok = engine.tokenizer
    text = "def parse(text):\n    return json.loads(text)\n"
    ids = tok.encode(text)
    # Feed a known token stream through the detokenizer: the stop string straddles tokens.
    det = IncrementalDetokenizer(tok, stop=["json.lo"])
    streamed, stop = "", None
    for t in ids:
        stop = det.append(t)
        if stop:
            det.finish(flush=False)
        streamed += det.take_new_text()
        if stop:
            break
        # nothing that could still be the start of the stop string has been released
        assert not streamed.endswith(("j", "js", "jso", "json", "json.", "json.l"))
    assert stop == "json.lo" and streamed == "def parse(text):\n    return "


def test_min_tokens_and_stop_token_ids(tiny_ckpt):
    engine = make_engine(tiny_ckpt, num_kv_blocks=64)
    prompt = [5, 6, 7]
    free = token_ids(run_all(engine, {"a": (prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))})["a"])
    stop_tok = free[2]
    first = free.index(stop_tok)
    out = run_all(engine, {"b": (prompt, SamplingParams(max_tokens=8, temperature=0, stop_token_ids=[stop_tok]))})["b"]
    assert token_ids(out) == free[:first + 1] and out[-1].finish_reason == "stop"
    # min_tokens bans the stop token until enough tokens exist
    out = run_all(engine, {"c": (prompt, SamplingParams(max_tokens=8, temperature=0, stop_token_ids=[stop_tok],
                                                        min_tokens=first + 2))})["c"]
    ids = token_ids(out)
    assert stop_tok not in ids[:first + 2]


def test_penalties_change_logits_as_specified():
    from tessera.inference.sample.sampler import apply_penalties

    class S:  # the fields apply_penalties reads
        prompt_ids = [0]
        output_ids = [1, 1, 2]
        params = SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)

    row = torch.tensor([2.0, -2.0, 1.0, 3.0])
    apply_penalties(row, S())
    assert row.tolist() == pytest.approx([1.0, -4.0 - 0.5 - 0.5, 0.5 - 0.5 - 0.25, 3.0])


def test_logit_bias_forces_and_bans_tokens(tiny_ckpt):
    """+100 makes a token the greedy choice at every step; -100 removes the free-running choice;
    a seeded sampled request with a bias reproduces; out-of-vocabulary ids are refused."""
    from tessera.inference.engine.llm_engine import RequestRejected, validate_request

    engine = make_engine(tiny_ckpt, num_kv_blocks=64)
    prompt = [5, 6, 7]
    free = token_ids(run_all(engine, {"a": (prompt, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))})["a"])
    forced_token = (free[0] + 3) % engine.loaded.config.vocab_size
    forced = run_all(engine, {"b": (prompt, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True,
                                                           logit_bias={forced_token: 100.0}))})["b"]
    assert token_ids(forced) == [forced_token] * 4
    banned = run_all(engine, {"c": (prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True,
                                                           logit_bias={free[0]: -100.0}))})["c"]
    assert token_ids(banned)[0] != free[0]
    with pytest.raises(ValueError):
        SamplingParams(logit_bias={1: 101.0})
    with pytest.raises(RequestRejected):
        validate_request(prompt, SamplingParams(logit_bias={engine.loaded.config.vocab_size: 1.0}),
                         engine.loaded.config.vocab_size, 64)


def test_logprobs_are_log_softmax(tiny_ckpt):
    engine = make_engine(tiny_ckpt, num_kv_blocks=64)
    out = run_all(engine, {"a": ([9, 8, 7], SamplingParams(max_tokens=3, temperature=0, logprobs=3,
                                                           ignore_eos=True))})["a"]
    lps = [lp for o in out for lp in o.new_logprobs]
    assert len(lps) == 3
    for lp in lps:
        assert lp.top[0][0] == lp.token_id and math.isclose(lp.top[0][1], lp.logprob, abs_tol=1e-6)
        assert sum(math.exp(v) for _, v in lp.top) <= 1.0 + 1e-6


def _random_request(rng: random.Random, vocab: int, i: int) -> Sequence:
    """A sequence with random settings of every kind the sampler applies, and random history."""
    greedy = rng.random() < 0.2
    params = SamplingParams(
        max_tokens=32, min_tokens=rng.choice([0, 0, 3, 20]),
        temperature=0.0 if greedy else rng.uniform(0.3, 2.0),
        top_k=rng.choice([0, 0, 2, 5, 40]), top_p=rng.choice([1.0, 1.0, 0.9, 0.5]), min_p=rng.choice([0.0, 0.0, 0.05, 0.3]),
        repetition_penalty=rng.choice([1.0, 1.0, 1.3, 0.8]), presence_penalty=rng.choice([0.0, 0.7, -0.5]),
        frequency_penalty=rng.choice([0.0, 0.4, -0.3]), stop_token_ids=rng.sample(range(vocab), rng.randint(0, 2)),
        logit_bias={t: rng.uniform(-100, 100) for t in rng.sample(range(vocab), rng.choice([0, 0, 1, 3]))})
    return Sequence(request_id=f"r{i}", prompt_ids=[rng.randrange(vocab) for _ in range(rng.randint(1, 6))],
                    params=params, generator=torch.Generator().manual_seed(1000 + i), detokenizer=None,  # type: ignore[arg-type]
                    eos_ids=frozenset({rng.randrange(vocab)}), max_model_len=100,
                    output_ids=[rng.randrange(vocab) for _ in range(rng.randint(0, 8))])


def test_the_batched_sampler_draws_every_row_from_its_sampling_row(monkeypatch):
    """Speculative decoding is exact only if `verify` and a draft model sample from the row the
    Sampler draws from: for random settings (penalties, logit_bias, min_tokens, temperature, top-k,
    top-p, min-p, greedy), batched together, the Sampler's token of each request is the one
    `sampling_row` + `pick` choose with a generator of the same seed, from the same probabilities."""
    from tessera.inference.sample import sampler
    vocab = 48
    rng = random.Random(0)
    drawn: list[torch.Tensor] = []
    draw = sampler.draw

    def spy(row, generator):
        token, probs = draw(row, generator)
        drawn.append(probs)
        return token, probs

    for trial in range(25):
        seqs = [_random_request(rng, vocab, i) for i in range(8)]
        logits = torch.randn(len(seqs), vocab, generator=torch.Generator().manual_seed(trial)) * 3
        before = logits.clone()
        drawn.clear()
        with monkeypatch.context() as m:
            m.setattr(sampler, "draw", spy)
            chosen, _, failed = sampler.Sampler()(seqs, logits)
        assert not failed and torch.equal(logits, before)  # the caller's logits are left as they were
        sampled = iter(drawn)
        for seq, row, token in zip(seqs, logits, chosen):
            single = sampler.sampling_row(row, seq)
            want, probs = sampler.pick(single, seq.params, torch.Generator().manual_seed(seq.generator.initial_seed()))
            assert token == want, (trial, seq.request_id, seq.params)
            if seq.params.greedy:
                assert probs is None
            else:
                assert torch.equal(next(sampled), probs), (trial, seq.request_id, seq.params)
        assert next(sampled, None) is None  # greedy rows drew nothing


def test_sampling_row_applies_each_setting_as_documented():
    """`sampling_row` against hand-computed rows: the penalties count the history, logit_bias adds,
    min_tokens bans EOS and the stop ids, then temperature and top-k."""
    logits = torch.tensor([1.0, 2.0, 0.5, -1.0, 3.0])
    params = SamplingParams(max_tokens=8, min_tokens=2, temperature=0.5, top_k=3, presence_penalty=1.0,
                            stop_token_ids=[2], logit_bias={3: 4.0})
    seq = Sequence(request_id="x", prompt_ids=[0], params=params, generator=torch.Generator(), detokenizer=None,  # type: ignore[arg-type]
                   eos_ids=frozenset({4}), max_model_len=100, output_ids=[1])
    row = sampling_row(logits, seq)
    inf = float("inf")
    # 1 was generated (presence -1); 3 biased +4; 2 (stop id) and 4 (EOS) banned; / 0.5; top-3 of 3 finite.
    assert row.tolist() == [2.0, 2.0, -inf, 6.0, -inf]
    seq.output_ids.append(0)  # two tokens now: min_tokens reached, EOS and the stop id come back
    assert sampling_row(logits, seq).tolist() == [-inf, 2.0, -inf, 6.0, 6.0]


def test_the_batched_greedy_pick_equals_torch_argmax_on_ties_nan_and_all_masked_rows():
    from tessera.inference.sample.sampler import argmax_rows

    with torch.inference_mode():
        logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(0))
        logits[1] = 2.0  # all equal: the first
        logits[2, [7, 9]] = 50.0  # a tie: the first of the two
        logits[3, 11] = float("nan")  # NaN counts as the largest
        logits[4] = float("-inf")  # nothing left
        logits[5, 299] = float("inf")
        for rows in (logits, logits[::2], logits.double()):
            assert argmax_rows(rows) == rows.argmax(dim=-1).tolist()
