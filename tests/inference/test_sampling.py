"""Sampling and stopping, against hand-computed expectations."""

from __future__ import annotations

import math

import pytest
import torch
from inference_helpers import make_engine, run_all, token_ids

from tessera.inference.detokenizer import IncrementalDetokenizer
from tessera.inference.sampler import filter_logits
from tessera.inference.sampling_params import SamplingParams


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
    from tessera.inference.sampler import apply_penalties

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
    from tessera.inference.engine import RequestRejected, validate_request

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
