"""Serving T5 (the encoder_decoder kind) from directories transformers saved: the prompt is the
encoder input, the encoder runs once per request and the decoder keeps paged self- and
cross-attention keys/values. Greedy completions over HTTP equal transformers' `generate` (T5 and
v1.1), alone and 32 at once with a cache small enough to preempt; what it cannot serve is refused
in one line."""

from __future__ import annotations

import json
import logging

import httpx
import pytest
import torch
from inference_helpers import check_alone_then_concurrent_greedy, make_engine, run_all, token_ids
from live_server import LiveServer
from test_hf_serving import _save

from tessera.common.errors import UserError, run_cli
from tessera.common.tokenizer import load_tokenizer
from tessera.inference.core.sampling_params import SamplingParams

VOCAB = 512  # the tiny tokenizer's


def hf_t5(variant: str):
    """A random tiny T5ForConditionalGeneration (T5: ReLU, tied head scaled by d_model**-0.5; v1.1:
    gated GELU, its own head) with informative norms, a head scaled so greedy choices are well
    separated, and few relative buckets over a short max distance so that the log-spaced buckets
    are reached by these short sequences."""
    import transformers

    v11 = variant == "v1_1"
    torch.manual_seed(0)
    config = transformers.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=2,
                                   num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=16,
                                   feed_forward_proj="gated-gelu" if v11 else "relu", tie_word_embeddings=not v11,
                                   decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    model = transformers.T5ForConditionalGeneration(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.normal_(1.0, 0.2)
            elif "relative_attention_bias" in name:
                p.mul_(5.0)
        model.get_output_embeddings().weight.mul_(10.0)
    return model.eval()


def t5_greedy(hf, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy generations, the prompts right-padded into one batch (the encoder's
    attention mask hides the padding)."""
    ids = torch.zeros(len(prompts), max(map(len, prompts)), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, :len(p)], mask[i, :len(p)] = torch.tensor(p), 1
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                          do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[:, 1:].tolist()  # past the decoder start token


@pytest.fixture(scope="module")
def exports(tiny_ckpt, tmp_path_factory):
    made = {}

    def get(variant: str):
        if variant not in made:
            hf = hf_t5(variant)
            made[variant] = hf, _save(hf, tiny_ckpt, tmp_path_factory.mktemp("t5") / variant)
        return made[variant]
    return get


@pytest.mark.parametrize("variant", ["t5", "v1_1"])
def test_one_and_32_concurrent_greedy_completions_with_preemption_equal_transformers_generate(exports, variant):
    """One request alone, then 32 at once over HTTP: encoder inputs of 5 to 36 tokens (one longer
    than the step's 32-token budget, run in a step of its own), decodes sharing steps with other
    requests' encoder prefills, and 12 blocks of 8 slots holding fewer sequences than run, so some
    are preempted and recomputed (encoder included)."""
    hf, export = exports(variant)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, VOCAB, (5 + i,), generator=gen).tolist() for i in range(32)]
    expected = t5_greedy(hf, prompts, 8)
    tokenizer = load_tokenizer(export)
    s = LiveServer(export, block_size=8, num_kv_blocks=12, max_model_len=48, max_num_batched_tokens=32,
                   max_num_seqs=32, enable_prefix_caching=False)
    try:
        check_alone_then_concurrent_greedy(s, prompts, expected, tokenizer, 8, first=3)
    finally:
        s.stop()


def test_put_api_and_chat_take_the_prompt_as_encoder_input_and_prompt_scoring_is_refused(exports, tmp_path):
    hf, export = exports("t5")
    tokenizer = load_tokenizer(export)
    s = LiveServer(export, block_size=8, num_kv_blocks=32, max_model_len=64)
    try:
        r = httpx.put(f"{s.url}/api", json={"prompts": ["import os", "def f("], "tokens_to_generate": 4,
                                             "top_k": 1}, timeout=30)
        assert r.status_code == 200, r.text
        for prompt, text in zip(["import os", "def f("], r.json()["text"]):
            want = tokenizer.decode(t5_greedy(hf, [tokenizer.encode(prompt)], 4)[0])
            assert text == prompt + want  # Megatron's reply: the prompt, then what was generated
        chat = httpx.post(f"{s.url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                                 "max_tokens": 3, "temperature": 0}, timeout=30)
        assert chat.status_code == 200, chat.text
        for method, path, body in (("PUT", "/api", {"prompts": ["a b"], "tokens_to_generate": 2, "logprobs": True}),
                                   ("POST", "/v1/completions", {"prompt": "a b", "echo": True, "logprobs": 1,
                                                                "max_tokens": 2})):
            bad = httpx.request(method, f"{s.url}{path}", json=body, timeout=30)
            assert bad.status_code == 400, bad.text
            assert "encoder-decoder" in bad.text and "\n" not in bad.text
    finally:
        s.stop()
    plain = tmp_path / "no_template"
    plain.mkdir()
    for f in export.iterdir():
        (plain / f.name).write_bytes(f.read_bytes())
    config = json.loads((plain / "tokenizer_config.json").read_text())
    config.pop("chat_template")
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    s = LiveServer(plain, block_size=8, num_kv_blocks=32, max_model_len=64)
    try:
        chat = httpx.post(f"{s.url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                                 "max_tokens": 3}, timeout=30)
        assert chat.status_code == 400 and "no chat template" in chat.json()["error"]["message"]
    finally:
        s.stop()


def test_prefix_caching_is_off_with_one_warning_so_prompts_sharing_a_prefix_stay_exact(exports, caplog):
    """A decoder block's keys/values depend on the whole encoder input: prompts that share their first
    two blocks but differ after must not share cached blocks."""
    hf, export = exports("v1_1")
    with caplog.at_level(logging.WARNING, logger="tessera.inference"):
        engine = make_engine(export, block_size=8, num_kv_blocks=64, enable_prefix_caching=True)
    assert engine.max_model_len == 512  # T5 has no position table: the kind's default, not the config's bound
    assert sum("prefix caching: off for this encoder-decoder" in r.getMessage() for r in caplog.records) == 1
    head = list(range(10, 26))
    prompts = [head + [40, 41, 42], head + [90, 91, 92, 93], head + [40, 41, 42]]
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    outs = run_all(engine, {f"r{i}": (p, params) for i, p in enumerate(prompts)})
    assert [token_ids(outs[f"r{i}"]) for i in range(3)] == t5_greedy(hf, prompts, 5)
    assert engine.blocks.prefix_hits == 0


def test_tessera_serve_refuses_a_tensor_parallel_size_that_does_not_divide_t5s_heads_in_one_line(exports, capsys):
    """Checked on the driver before any worker starts (the tiny model has 4 heads)."""
    from tessera.inference.entrypoints.serve_cli import main

    _, export = exports("t5")
    capsys.readouterr()  # the fixture's progress lines, when it made the export now
    with pytest.raises(SystemExit) as exc:
        run_cli(main, ["--checkpoint", str(export), "--tensor-parallel", "3", "--no-engine-process"])
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and len(err.splitlines()) == 1, err
    assert "--tensor-parallel 3: must divide the 4 attention heads" in err, err


@pytest.mark.parametrize("flag", [{"speculative": {"method": "ngram", "num_speculative_tokens": 2,
                                                   "prompt_lookup_max": 2}},
                                  {"padded_decode": True}])
def test_speculative_decoding_and_padded_decode_are_refused_in_one_line(exports, flag):
    _, export = exports("t5")
    with pytest.raises(UserError) as err:
        make_engine(export, block_size=8, num_kv_blocks=32, max_model_len=64, **flag)
    name = {"speculative": "--speculative-config", "padded_decode": "--padded-decode"}[next(iter(flag))]
    assert str(err.value).startswith(name) and "\n" not in str(err.value) and "drop" in str(err.value)


def test_a_step_mixes_a_new_requests_encoder_prefill_with_running_decodes(exports):
    hf, export = exports("t5")
    engine = make_engine(export, block_size=8, num_kv_blocks=32, max_model_len=64, enable_prefix_caching=False)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompts = [list(range(30, 41)), list(range(100, 117))]
    outs: dict[str, list] = {"a": [], "b": []}
    engine.add_request("a", prompts[0], params)
    for out in engine.step() + engine.step():
        outs[out.request_id].append(out)
    engine.add_request("b", prompts[1], params)
    plan = engine.scheduler.schedule()  # what the next step will run, scheduled here to look at it
    assert [(s.seq.request_id, s.start, s.num_new) for s in plan.scheduled] == [("a", 12, 1), ("b", 0, 17)]
    result = engine.runner.execute(plan)
    for out in engine.processor.update(plan, result)[0]:
        outs[out.request_id].append(out)
    engine.run_to_completion(lambda o: outs[o.request_id].append(o))
    assert [token_ids(outs[r]) for r in ("a", "b")] == t5_greedy(hf, prompts, 6)
