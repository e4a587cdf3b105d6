"""Speculative decoding (n-gram prompt lookup and a draft model) changes how many forwards a
sequence takes, never what it outputs: greedy output is token for token the output without it,
batched with non-speculating requests; sampled tokens are distributed as the target's (chi-square
against the exact distribution, and with vs without speculation through the engine); the
paged KV cache gives back every block; bad configurations are one line and exit 2."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from inference_helpers import (
    assert_kv_and_drafter_caches_fill_the_budget,
    generate_usage_error,
    make_checkpoint,
    make_engine,
    run_all,
    tiny_config,
    token_ids,
)

from tessera.common.checkpoint import (
    CheckpointSidecar,
    finalize_checkpoint,
    load_model_tensors,
    read_sidecar,
    resolve_checkpoint,
    save_model_tensors,
    write_pointer,
)
from tessera.inference.config import SpeculativeConfig
from tessera.inference.core.sampling_params import SamplingParams
from tessera.inference.core.sequence import Sequence
from tessera.inference.sample.sampler import verify
from tessera.inference.spec_decode.proposers import NgramProposer

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def greedy(n: int = 24, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def prompts() -> dict[str, list[int]]:
    g = torch.Generator().manual_seed(3)
    out = {f"rand{i}": torch.randint(3, 512, (n,), generator=g).tolist() for i, n in enumerate((5, 19, 40))}
    out["repeat"] = [11, 12, 13, 14, 15, 16] * 6  # prompt lookup finds the continuation
    out["repeat_long"] = list(range(40, 60)) * 3
    return out


@pytest.fixture(scope="module")
def draft_ckpt(tmp_path_factory):
    """A smaller model (one layer, other weights) with the target's tokenizer."""
    return make_checkpoint(tmp_path_factory.mktemp("draft"), tiny_config(num_layers=1, hidden_size=32, num_heads=2,
                                                                         num_kv_heads=1, ffn_hidden_size=64), seed=5)


@pytest.fixture(scope="module")
def noisy_ckpt(tiny_ckpt, tmp_path_factory):
    """The target's weights plus noise: a draft that agrees with it often, not always."""
    src = resolve_checkpoint(tiny_ckpt)
    g = torch.Generator().manual_seed(11)
    tensors = {k: v + 0.5 * v.std() * torch.randn(v.shape, generator=g) if v.numel() > 1 else v
               for k, v in load_model_tensors(src).items()}
    it = tmp_path_factory.mktemp("noisy") / "checkpoints" / "iter_0000001"
    it.mkdir(parents=True)
    save_model_tensors(it, tensors)
    shutil.copytree(src / "tokenizer", it / "tokenizer")
    finalize_checkpoint(it, CheckpointSidecar(model=read_sidecar(src).model, step=1))
    write_pointer(it.parent, 1)
    return it.parent.parent


def run(engine, requests):
    outs = run_all(engine, requests)
    assert engine.blocks.num_used == 0
    return {rid: token_ids(o) for rid, o in outs.items()}, outs


@pytest.fixture(scope="module")
def plain(tiny_ckpt):
    engine = make_engine(tiny_ckpt, block_size=8, num_kv_blocks=128)
    return run(engine, {rid: (ids, greedy()) for rid, ids in prompts().items()})[0]


@pytest.mark.parametrize("k", [1, 4])
def test_greedy_output_with_ngram_speculation_is_the_output_without_it(tiny_ckpt, plain, k):
    engine = make_engine(tiny_ckpt, block_size=8, num_kv_blocks=128,
                         speculative=SpeculativeConfig(**{**NGRAM, "num_speculative_tokens": k}))
    got, _ = run(engine, {rid: (ids, greedy()) for rid, ids in prompts().items()})
    assert got == plain
    st = engine.stats()
    assert st.spec_num_drafts > 0 and 0 < st.spec_num_accepted_tokens < st.spec_num_draft_tokens
    assert sum(st.spec_accepted_per_pos) == st.spec_num_accepted_tokens
    assert len(st.spec_accepted_per_pos) == k


def test_prompt_lookup_is_accepted_where_the_model_repeats_and_rejected_where_it_does_not(tiny_ckpt, plain):
    # A random model does not copy its prompt: a prompt of a repeated slice gets proposals that
    # are rejected. Greedy, it falls into loops of its own: a prompt that ends in such a loop
    # gets proposals that are accepted.
    def run_ngram(ids: list[int]) -> tuple[list[int], float]:
        engine = make_engine(tiny_ckpt, block_size=8, num_kv_blocks=128, speculative=SpeculativeConfig(**NGRAM))
        got, _ = run(engine, {"r": (ids, greedy(48))})
        st = engine.stats()
        assert st.spec_num_draft_tokens >= 12
        return got["r"], st.spec_num_accepted_tokens / st.spec_num_draft_tokens

    got, rate = run_ngram(prompts()["repeat_long"])
    assert got[:24] == plain["repeat_long"] and rate < 0.3
    loop = prompts()["rand1"] + plain["rand1"]
    reference = make_engine(tiny_ckpt, block_size=8, num_kv_blocks=128)
    want, _ = run(reference, {"r": (loop, greedy(48))})
    got, rate = run_ngram(loop)
    assert got == want["r"] and rate > 0.6


@pytest.mark.parametrize("draft", ["small", "noisy"])
def test_greedy_output_with_a_draft_model_is_the_output_without_it(tiny_ckpt, draft_ckpt, noisy_ckpt, plain, draft):
    path = draft_ckpt if draft == "small" else noisy_ckpt
    engine = make_engine(tiny_ckpt, block_size=8, num_kv_blocks=128,
                         speculative=SpeculativeConfig(model=str(path), num_speculative_tokens=3))
    got, _ = run(engine, {rid: (ids, greedy()) for rid, ids in prompts().items()})
    assert got == plain
    st = engine.stats()
    assert st.spec_num_drafts > 0
    if draft == "noisy":  # some drafts accepted, some rejected
        assert 0 < st.spec_num_accepted_tokens < st.spec_num_draft_tokens
    assert engine.proposer.blocks.num_used == 0  # the draft's caches are released with their requests


def test_the_draft_models_cache_comes_out_of_kv_cache_memory_beside_the_targets(tiny_ckpt, draft_ckpt):
    budget = 256 * 1024
    alone = make_engine(tiny_ckpt, block_size=8, kv_cache_memory=budget)
    engine = make_engine(tiny_ckpt, block_size=8, kv_cache_memory=budget,
                         speculative=SpeculativeConfig(model=str(draft_ckpt), num_speculative_tokens=2))
    assert_kv_and_drafter_caches_fill_the_budget(engine, budget)
    # Target blocks of 4 KiB (2 layers x K/V x 2 heads x 16 x fp32 x 8 tokens), the draft's 1 KiB.
    assert (alone.blocks.num_blocks, engine.blocks.num_blocks) == (64, 51)


def test_the_target_as_its_own_draft_has_every_greedy_draft_accepted(tiny_ckpt, plain):
    engine = make_engine(tiny_ckpt, block_size=8, num_kv_blocks=128,
                         speculative=SpeculativeConfig(model=str(tiny_ckpt), num_speculative_tokens=3))
    got, _ = run(engine, {rid: (ids, greedy()) for rid, ids in prompts().items()})
    assert got == plain
    st = engine.stats()
    assert st.spec_num_accepted_tokens == st.spec_num_draft_tokens > 0


def test_speculating_and_plain_rows_share_batches_under_a_small_budget(tiny_ckpt, plain):
    # Stop strings, logprobs, penalties and min_tokens speculate; a tight token budget cuts drafts and
    # mixes prefill chunks, speculative rows and single-token decodes in one step.
    engine = make_engine(tiny_ckpt, block_size=4, num_kv_blocks=160, max_num_batched_tokens=12, max_num_seqs=6,
                         speculative=SpeculativeConfig(**NGRAM))
    reference = make_engine(tiny_ckpt, block_size=4, num_kv_blocks=160, max_num_batched_tokens=12, max_num_seqs=6)
    ps = prompts()
    loop = ps["rand1"] + plain["rand1"]  # ends in a loop of the model's own: drafts are accepted
    reqs = {rid: (ps[rid], greedy(12)) for rid in ("rand0", "rand2")}
    reqs["pen"] = (loop, greedy(16, repetition_penalty=1.3, frequency_penalty=0.5, min_tokens=14))
    reqs["lp"] = (loop, greedy(16, logprobs=2))
    reqs["short"] = (loop, greedy(n=3))
    got, outs = run(engine, reqs)
    want, ref_outs = run(reference, reqs)
    assert got == want
    for a, b in zip([lp for o in outs["lp"] for lp in o.new_logprobs], [lp for o in ref_outs["lp"] for lp in o.new_logprobs]):
        assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
    assert len(got["short"]) == 3 and outs["short"][-1].finish_reason == "length"
    assert engine.stats().spec_num_accepted_tokens > 0


def test_a_stop_token_inside_accepted_drafts_ends_the_output_there(tiny_ckpt, plain):
    out = plain["repeat_long"]
    # Token 0 comes from the prefill, then 1 + 4 per step: a first occurrence that is not a step's
    # last token is a stop inside the accepted drafts.
    first = next(i for i in range(2, len(out)) if out.index(out[i]) == i and (i - 1) % 5 != 4)
    stop = out[first]
    # The model as its own draft: every draft is accepted, so the stop falls inside the drafts.
    engine = make_engine(tiny_ckpt, block_size=8, num_kv_blocks=128,
                         speculative=SpeculativeConfig(model=str(tiny_ckpt), num_speculative_tokens=4))
    commit, committed = engine.blocks.commit_full_blocks, []

    def spy(seq):  # the prefix cache hashes blocks of computed tokens of the sequence only
        committed.append((seq.num_computed, seq.num_tokens))
        commit(seq)

    engine.blocks.commit_full_blocks = spy
    got, outs = run(engine, {"r": (prompts()["repeat_long"], greedy(stop_token_ids=[stop]))})
    assert got["r"] == out[:first + 1] and outs["r"][-1].finish_reason == "stop"
    assert committed and all(computed <= tokens for computed, tokens in committed), committed


def test_ngram_proposer_takes_the_longest_most_recent_match():
    cfg = SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_max=3, prompt_lookup_min=1)
    seq = _seq([1, 2, 3, 9, 9, 2, 3, 7, 8, 1, 2, 3], SamplingParams(max_tokens=10))
    # "1 2 3" (length 3) occurred at the start, followed by 9 9 2; "2 3" alone more recently (7 8 1).
    assert NgramProposer(cfg).lookup(seq, 3) == [9, 9, 2]
    seq = _seq([5, 6, 7, 5], SamplingParams(max_tokens=10))
    assert NgramProposer(cfg).lookup(seq, 3) == [6, 7, 5]
    assert NgramProposer(cfg).lookup(_seq([1, 2, 3, 4], SamplingParams(max_tokens=10)), 3) == []


# ---- the distribution -------------------------------------------------------------------------

def _seq(prompt: list[int], params: SamplingParams, seed: int = 0) -> Sequence:
    return Sequence(request_id="x", prompt_ids=prompt, params=params, generator=torch.Generator().manual_seed(seed),
                    detokenizer=None, eos_ids=frozenset(), max_model_len=1000)  # type: ignore[arg-type]


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of observed counts against expected probabilities (cells with p > 0)."""
    keep = probs > 0
    n = counts.sum()
    expected = probs[keep] * n
    stat = ((counts[keep] - expected) ** 2 / expected).sum()
    df = int(keep.sum()) - 1
    assert counts[~keep].sum() == 0, "a token of probability 0 was emitted"
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64), stat.double() / 2))


@pytest.mark.parametrize("draft", ["ngram", "draft_model"])
def test_rejection_sampling_emits_the_target_distribution(draft):
    vocab, n = 5, 4000
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, vocab, generator=g)  # target rows at the newest token and two drafts
    drafts = [2, 3]
    logits[0, 2] += 3.0  # draft 0 is likely enough to be accepted often, and likely in row 1 too,
    logits[1, 2] += 1.5  # where the frequency penalty must count it
    params = SamplingParams(max_tokens=10, temperature=0.8, frequency_penalty=1.5)
    prompt = [0, 1]
    q = None
    if draft == "draft_model":
        q = torch.softmax(torch.randn(2, vocab, generator=g), -1)
        q[0, 2] += 0.5  # token 2 is drafted often
        q = q / q.sum(-1, keepdim=True)
    seq = _seq(prompt, params, seed=1)
    first = torch.zeros(vocab)
    second = torch.zeros(vocab)  # after the first draft was accepted
    proposer = torch.Generator().manual_seed(2)
    for _ in range(n):
        if q is not None:  # a draft model's tokens are drawn from its distributions
            drafts = [int(torch.multinomial(q[j], 1, generator=proposer)) for j in range(2)]
        out = verify(seq, drafts, q, logits)
        first[out[0]] += 1
        if out[0] == 2 and len(out) > 1:  # token 2 was drafted and accepted
            second[out[1]] += 1
    # Exact: position 0 from the tempered row; position 1 with the frequency penalty counting draft 0.
    p0 = torch.softmax(logits[0] / 0.8, -1)
    row1 = logits[1].clone()
    row1[2] -= 1.5
    p1 = torch.softmax(row1 / 0.8, -1)
    assert chi_square_p(first, p0) > 1e-3
    assert chi_square_p(second, p1) > 1e-3
    # The test has power: the unpenalized second row is told apart.
    assert chi_square_p(second, torch.softmax(logits[1] / 0.8, -1)) < 1e-3


def test_sampled_outputs_through_the_engine_are_distributed_as_without_speculation(tiny_ckpt, noisy_ckpt):
    # top_k=3 leaves three tokens per position: the first three output tokens of 300 seeded
    # requests, with and without a draft model, pass a two-sample chi-square test per position.
    n = 300
    prompt = prompts()["repeat"]

    def sample(spec) -> list[torch.Tensor]:
        engine = make_engine(tiny_ckpt, block_size=8, num_kv_blocks=512, max_num_seqs=64, speculative=spec)
        reqs = {f"s{i}": (prompt, SamplingParams(max_tokens=3, temperature=1.5, top_k=3, ignore_eos=True, seed=i))
                for i in range(n)}
        got, _ = run(engine, reqs)
        return [torch.tensor([got[f"s{i}"][j] for i in range(n)]) for j in range(3)]

    spec = SpeculativeConfig(model=str(noisy_ckpt), num_speculative_tokens=2)
    for a, b in zip(sample(None), sample(spec)):
        tokens = torch.unique(torch.cat([a, b]))
        ca = torch.stack([(a == t).sum() for t in tokens]).double()
        cb = torch.stack([(b == t).sum() for t in tokens]).double()
        pooled = (ca + cb) / (2 * n)
        stat = (((ca - n * pooled) ** 2 + (cb - n * pooled) ** 2) / (n * pooled)).sum()
        p = float(torch.special.gammaincc(torch.tensor((len(tokens) - 1) / 2.0, dtype=torch.float64), stat / 2))
        assert p > 1e-3, (ca, cb)


# ---- bad input --------------------------------------------------------------------------------

@pytest.mark.parametrize("spec, expected", [
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens: Input should be greater than 0"),
    ('{"method": "ngram", "num_speculative_tokens": -2}', "num_speculative_tokens"),
    ('{"method": "eagle", "num_speculative_tokens": 2}', "--speculative-config method: Input should be"),
    ('{"method": "ngram"}', "num_speculative_tokens: Field required"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}',
     "prompt_lookup_min (4) must be <= prompt_lookup_max (2)"),
    ('{"method": "draft_model", "num_speculative_tokens": 2}', 'needs "model"'),
    ('{"num_speculative_tokens": 2, "typo": 1}', "typo: Extra inputs are not permitted"),
    ("ngram", "not valid JSON"),
])
def test_bad_speculative_config_is_one_line_exit_2(tmp_path, capsys, spec, expected):
    err = _generate_error(tmp_path, capsys, tmp_path, ["--speculative-config", spec])
    assert "error: --speculative-config" in err and expected in err, err


def test_a_draft_model_with_another_tokenizer_is_refused_before_loading_weights(tmp_path, tiny_ckpt, capsys,
                                                                                 monkeypatch):
    import tessera.inference.worker.loader as loader

    def no_weights(*a, **k):
        raise AssertionError("weights were loaded")

    monkeypatch.setattr(loader, "load_for_serving", no_weights)
    other = make_checkpoint(tmp_path / "other", tiny_config(num_layers=1), tokenizer_vocab=400)  # other merges
    spec = json.dumps({"model": str(other), "num_speculative_tokens": 2})
    err = _generate_error(tmp_path, capsys, tiny_ckpt, ["--speculative-config", spec])
    assert "tokenizer differs from the target's" in err and str(other) in err
    small = make_checkpoint(tmp_path / "small", tiny_config(num_layers=1, vocab_size=640))
    spec = json.dumps({"model": str(small), "num_speculative_tokens": 2})
    err = _generate_error(tmp_path, capsys, tiny_ckpt, ["--speculative-config", spec])
    assert "vocabulary has 640 entries, the target's 512" in err


def _generate_error(tmp_path, capsys, ckpt, extra) -> str:
    prompts_file = tmp_path / "p.jsonl"
    prompts_file.write_text('{"prompt": "hi"}\n')
    return generate_usage_error(["--checkpoint", ckpt, "--prompts", prompts_file, "--output", tmp_path / "o.jsonl",
                                 *extra], capsys)


# ---- metrics ----------------------------------------------------------------------------------

def test_speculative_counts_reach_prometheus_under_vllms_names_and_the_log(tiny_ckpt, caplog):
    from tessera.inference.engine.metrics import ServingMetrics
    from tessera.inference.engine.wire import stats_from_wire, stats_to_wire

    engine = make_engine(tiny_ckpt, block_size=8, num_kv_blocks=128, speculative=SpeculativeConfig(**NGRAM))
    run(engine, {"r": (prompts()["rand1"], greedy(48))})
    stats = stats_from_wire(json.loads(json.dumps(stats_to_wire(engine.stats()))))  # as from the engine process
    assert stats == engine.stats() and stats.spec_num_accepted_tokens > 0
    metrics = ServingMetrics("m")
    with caplog.at_level("INFO", logger="tessera.inference"):
        metrics.update_engine(stats)
    text = metrics.render().decode()
    assert f'vllm:spec_decode_num_drafts_total{{engine="0",model_name="m"}} {float(stats.spec_num_drafts)}' in text
    assert f'vllm:spec_decode_num_draft_tokens_total{{engine="0",model_name="m"}} {float(stats.spec_num_draft_tokens)}' in text
    assert (f'vllm:spec_decode_num_accepted_tokens_total{{engine="0",model_name="m"}} '
            f'{float(stats.spec_num_accepted_tokens)}') in text
    for pos, count in enumerate(stats.spec_accepted_per_pos):
        assert (f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="m",position="{pos}"}} '
                f'{float(count)}') in text
    rate = 100 * stats.spec_num_accepted_tokens / stats.spec_num_draft_tokens
    assert f"acceptance rate {rate:.1f}%" in caplog.text


@pytest.mark.slow
def test_served_from_the_engine_process_with_speculation_the_answers_are_the_same(tiny_ckpt, plain):
    import httpx
    from test_engine_process import ProcessServer

    loop = prompts()["rand1"] + plain["rand1"]
    server = ProcessServer(tiny_ckpt, block_size=8, num_kv_blocks=256, speculative=SpeculativeConfig(**NGRAM))
    try:
        body = {"prompt": [loop, prompts()["rand0"]], "max_tokens": 20, "temperature": 0, "ignore_eos": True,
                "logprobs": 1}
        got = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
        reference = make_engine(tiny_ckpt, block_size=8, num_kv_blocks=256)
        want = run_all(reference, {"0": (loop, greedy(20, logprobs=1)), "1": (prompts()["rand0"], greedy(20, logprobs=1))})
        for choice in got["choices"]:
            outs = want[str(choice["index"])]
            assert choice["text"] == "".join(o.new_text for o in outs)
            assert choice["logprobs"]["token_logprobs"] == pytest.approx(
                [lp.logprob for o in outs for lp in o.new_logprobs], abs=1e-4)
        # Structured output decodes without drafts, in the same engine.
        schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 30, "temperature": 1.0,
                                                              "seed": 4, "guided_json": schema}, timeout=60).json()
        assert isinstance(json.loads(r["choices"][0]["text"])["n"], int)
        assert server.metric("vllm:spec_decode_num_accepted_tokens_total") > 0
        assert server.metric("vllm:spec_decode_num_drafts_total") > 0
    finally:
        server.stop()


def test_tessera_generate_writes_the_same_completions_with_speculation_and_reports_acceptance(tiny_ckpt, plain,
                                                                                             tmp_path, capsys):
    from tessera.inference.entrypoints.generate_cli import main

    loop = prompts()["rand1"] + plain["rand1"]
    lines = [{"prompt": loop, "ignore_eos": True}, {"prompt": prompts()["rand0"], "max_tokens": 5},
             {"prompt": "def f(x):", "temperature": 0.8, "seed": 3, "max_tokens": 6, "ignore_eos": True}]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    common = ["--checkpoint", str(tiny_ckpt), "--prompts", str(tmp_path / "p.jsonl"), "--max-tokens", "16",
              "--num-kv-blocks", "64", "--block-size", "8"]
    assert main([*common, "--output", str(tmp_path / "plain.jsonl"), "--quiet"]) == 0
    assert main([*common, "--output", str(tmp_path / "spec.jsonl"), "--speculative-config", json.dumps(NGRAM)]) == 0
    plain_out = [json.loads(x) for x in (tmp_path / "plain.jsonl").read_text().splitlines()]
    spec_out = [json.loads(x) for x in (tmp_path / "spec.jsonl").read_text().splitlines()]
    assert spec_out[:2] == plain_out[:2]  # greedy: identical; the sampled line has the same length
    assert spec_out[2]["completion_tokens"] == plain_out[2]["completion_tokens"] == 6
    assert "speculative decoding: acceptance rate" in capsys.readouterr().out
