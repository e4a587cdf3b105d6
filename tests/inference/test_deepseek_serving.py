"""Serving DeepSeek-V3-class models (multi-head latent attention) from directories transformers
saved: a latent KV cache of kv_lora_rank + qk_rope_head_dim values per token and layer; prefill
chunks attend over up-projected latents, decodes with absorbed projections; greedy completions
over HTTP equal transformers' `generate`, for one request and for many at once with chunked
prefill and preemption."""

from __future__ import annotations

import pytest
import torch
from deepseek_hf import YARN, build_hf
from inference_helpers import (
    assert_kv_and_drafter_caches_fill_the_budget,
    check_alone_then_concurrent_greedy,
    hf_greedy,
    make_engine,
    run_all,
    token_ids,
)
from live_server import LiveServer
from test_hf_serving import _save

from tessera.common.tokenizer import load_tokenizer
from tessera.inference.config import SpeculativeConfig
from tessera.inference.core.sampling_params import SamplingParams

VOCAB = 512  # the tiny tokenizer's
# Smaller than the model tests' (2 layers: a dense first one, then group-limited MoE) to keep serving fast.
SMALL = dict(vocab_size=VOCAB, num_hidden_layers=2, max_position_embeddings=160)
MODELS = {
    "q-lora": dict(SMALL),
    "no-q-lora-yarn": dict(SMALL, q_lora_rank=None, rope_scaling=YARN),
}


@pytest.fixture(scope="module")
def exports(tiny_ckpt, tmp_path_factory):
    made = {}

    def get(name: str):
        if name not in made:
            hf = build_hf(**MODELS[name])
            with torch.no_grad():  # well-separated greedy choices
                hf.get_output_embeddings().weight.mul_(8.0)
            made[name] = hf, _save(hf, tiny_ckpt, tmp_path_factory.mktemp("hf") / name)
        return made[name]
    return get


@pytest.fixture(scope="module", params=list(MODELS))
def deepseek(request, exports):
    return exports(request.param)


def _prompts(n: int, lo: int, seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(2, VOCAB, (lo + i,), generator=gen).tolist() for i in range(n)]


def test_one_request_and_sixteen_concurrent_with_chunked_prefill_and_preemption_equal_transformers_generate(deepseek):
    """Over HTTP: one request alone, then 16 at once whose prompts of 20 to 35 tokens are prefilled
    16 tokens per step (later chunks attend over the latents of earlier ones) beside other requests'
    decodes, in 10 blocks of 8 tokens: fewer than the running sequences need, so some are preempted
    and recomputed."""
    hf, export = deepseek
    prompts = _prompts(16, 20)
    expected = [hf_greedy(hf, p, 5) for p in prompts]
    tokenizer = load_tokenizer(export)
    s = LiveServer(export, block_size=8, num_kv_blocks=10, max_model_len=48, max_num_batched_tokens=16,
                   max_num_seqs=16)
    try:
        check_alone_then_concurrent_greedy(s, prompts, expected, tokenizer, 5)
    finally:
        s.stop()


@pytest.mark.parametrize("kv_dtype,size", [("auto", 4), ("fp8", 1)])
def test_kv_bytes_per_token_are_the_latent_and_rope_key_of_each_layer_and_the_summary_compares_full_kv(
        exports, kv_dtype, size):
    hf, export = exports("q-lora")
    c = hf.config
    engine = make_engine(export, block_size=8, kv_cache_memory=64 * 1024, max_model_len=48, kv_cache_dtype=kv_dtype)
    runner = engine.runner
    per_token = (c.kv_lora_rank + c.qk_rope_head_dim) * c.num_hidden_layers * size  # fp32 model
    assert runner.kv.numel() * runner.kv.element_size() == runner.num_blocks * 8 * per_token
    assert engine.blocks.num_blocks == 64 * 1024 // (8 * per_token)
    full = c.num_hidden_layers * c.num_attention_heads * (c.qk_nope_head_dim + c.qk_rope_head_dim + c.v_head_dim) * size
    tokens = engine.blocks.num_blocks * 8
    assert runner.state_summary() == (
        f"latent KV cache ({c.kv_lora_rank} + {c.qk_rope_head_dim} values per token and layer): {tokens} tokens, "
        f"{tokens * per_token // full} with full K/V ({tokens / (tokens * per_token // full):.1f}x)")


def test_greedy_output_with_speculative_rows_and_a_shared_prefix_equals_generate(exports):
    """Draft rows (1 + k tokens) attend over latents with absorbed queries; a second request reuses
    the first's cached prompt blocks (prefix caching) and prefills only its own tail."""
    hf, export = exports("q-lora")
    base = _prompts(1, 24, seed=3)[0]
    prompts = {"loop": (base[:6] * 5)[:28], "a": base, "b": base[:16] + [7, 8, 9, 10, 11]}
    engine = make_engine(export, block_size=8, num_kv_blocks=64, max_model_len=64,
                         speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_max=3,
                                                       prompt_lookup_min=1))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    got = run_all(engine, {"loop": (prompts["loop"], params), "a": (prompts["a"], params)})
    got.update(run_all(engine, {"b": (prompts["b"], params)}))
    for name, prompt in prompts.items():
        assert token_ids(got[name]) == hf_greedy(hf, prompt, 8), name
    stats = engine.stats()
    assert stats.spec_num_draft_tokens > 0 and stats.spec_num_accepted_tokens > 0
    assert stats.prefix_hits >= 16  # b's first two blocks came from a's


def test_decode_through_the_triton_paged_attention_kernel_over_latents_equals_generate(exports, monkeypatch):
    """The CUDA path (the decoder's Triton kernel, run here by its interpreter): the latent is both
    key and value, and the value's RoPE columns are dropped after attending."""
    import tessera.kernels.paged_attention_triton as kernel

    hf, export = exports("no-q-lora-yarn")
    monkeypatch.setenv("TESSERA_FORCE_TRITON", "1")
    calls = []
    launch = kernel.paged_attention_triton
    monkeypatch.setattr(kernel, "paged_attention_triton", lambda *a, **k: calls.append(a[0].shape) or launch(*a, **k))
    engine = make_engine(export, block_size=8, num_kv_blocks=32, max_model_len=48)
    engine.runner.kernel_decode = True
    prompts = _prompts(2, 9, seed=5)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    got = run_all(engine, {str(i): (p, params) for i, p in enumerate(prompts)})
    assert [token_ids(got[str(i)]) for i in range(2)] == [hf_greedy(hf, p, 4) for p in prompts]
    c = hf.config
    assert calls and all(shape[1:] == (c.num_attention_heads, c.kv_lora_rank + c.qk_rope_head_dim) for shape in calls)


def test_the_startup_line_says_how_many_tokens_the_latent_cache_holds_against_full_kv(exports, capsys, monkeypatch):
    import uvicorn

    from tessera.inference.entrypoints.serve_cli import main

    _, export = exports("q-lora")
    async def stop_at_once(self, *args, **kwargs):  # the line is printed once listening; then it stops
        return None

    monkeypatch.setattr(uvicorn.Server, "main_loop", stop_at_once)
    capsys.readouterr()
    assert main(["--checkpoint", str(export), "--no-engine-process", "--port", "0", "--kv-cache-memory", "98304",
                 "--block-size", "8", "--max-model-len", "48", "--enforce-eager"]) == 0
    err = capsys.readouterr().err
    assert "sampling defaults" not in err  # the model has no generation_config.json: nothing to log, as vLLM
    line = next(x for x in err.splitlines() if x.startswith("tessera-serve:"))
    # 98304 bytes / (24 values x 2 layers x 4 bytes) = 512 tokens; full K/V: 4 heads x (24 + 12) x 2 x 4
    assert "64 KV blocks x 8 tokens, latent KV cache (16 + 8 values per token and layer): 512 tokens, " \
           "85 with full K/V (6.0x)" in line, line


def test_bf16_serving_with_packed_linear_layers_completes_and_starts_as_fp32_transformers(exports):
    """bf16 weights (oneDNN-packed) over fp32 RoPE tables: queries and latents are cast back to the
    model's dtype before the cache and the packed GEMMs see them. Each first token is fp32
    transformers' best or within bf16 rounding of it (random tiny models have near ties)."""
    from tessera.inference.config import EngineConfig
    from tessera.inference.engine.llm_engine import LLMEngine
    from tessera.inference.worker.loader import load_for_serving

    hf, export = exports("q-lora")
    cpu = torch.device("cpu")
    loaded = load_for_serving(export, cpu, torch.bfloat16)
    engine = LLMEngine(loaded, EngineConfig(block_size=8, num_kv_blocks=32, max_model_len=48, dtype="bfloat16"),
                       cpu, torch.bfloat16)
    assert engine.runner.kv.dtype == torch.bfloat16
    prompts = _prompts(3, 20)
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    got = run_all(engine, {str(i): (p, params) for i, p in enumerate(prompts)})
    for i, p in enumerate(prompts):
        tokens = token_ids(got[str(i)])
        with torch.no_grad():
            logits = hf(torch.tensor([p])).logits[0, -1]
        assert len(tokens) == 5 and logits[tokens[0]] >= logits.max() - 0.05, (tokens, logits.topk(3))


def mtp_export(tiny_ckpt, directory):
    """(transformers model, a tiny DeepSeek-V3 directory with DeepSeek's MTP layer (num_nextn_predict_layers=1))."""
    from deepseek_hf import save_with_mtp

    hf = build_hf(**MODELS["q-lora"])
    with torch.no_grad():
        hf.get_output_embeddings().weight.mul_(8.0)
    out = _save(hf, tiny_ckpt, directory)
    save_with_mtp(hf, out)
    return hf, out


def record_drafts(monkeypatch) -> list[tuple[list[int], list[int]]]:
    """Every draft the MTP proposer makes from now on: (the sequence's tokens, its drafts)."""
    from tessera.inference.spec_decode.mtp import MTPProposer

    drafts: list[tuple[list[int], list[int]]] = []
    propose = MTPProposer.propose

    def spy(self, running):
        propose(self, running)
        drafts.extend((s.tokens(0, s.num_tokens), list(s.spec_token_ids)) for s in running if s.spec_token_ids)
    monkeypatch.setattr(MTPProposer, "propose", spy)
    return drafts


@pytest.fixture(scope="module")
def with_mtp(tiny_ckpt, tmp_path_factory):
    return mtp_export(tiny_ckpt, tmp_path_factory.mktemp("hf") / "mtp")


def test_mtp_drafts_are_the_mtp_modules_greedy_choice_and_the_output_equals_generate(with_mtp, monkeypatch):
    """10 requests with chunked prefill and preemption; each first draft is the MTP depth's argmax
    over the target's hidden states of the sequence so far (checked against the model run whole)."""
    from tessera.inference.spec_decode.proposers import MTPProposer
    from tessera.inference.worker.loader import load_for_serving

    hf, export = with_mtp
    proposed: list[tuple[list[int], int]] = []
    propose = MTPProposer.propose

    def spy(self, running):
        propose(self, running)
        proposed.extend((s.tokens(0, s.num_tokens), s.spec_token_ids[0]) for s in running if s.spec_token_ids)
    monkeypatch.setattr(MTPProposer, "propose", spy)
    engine = make_engine(export, block_size=8, num_kv_blocks=8, max_model_len=48, max_num_batched_tokens=16,
                         max_num_seqs=16, enable_prefix_caching=False,
                         speculative=SpeculativeConfig(method="mtp", num_speculative_tokens=2))
    prompts = _prompts(10, 14)
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    got = run_all(engine, {str(i): (p, params) for i, p in enumerate(prompts)})
    for i, p in enumerate(prompts):
        assert token_ids(got[str(i)]) == hf_greedy(hf, p, 5), i
    stats = engine.stats()
    assert engine.scheduler.num_preemptions > 0 and stats.spec_num_draft_tokens > 0
    model = load_for_serving(export, torch.device("cpu"), torch.float32).model  # the plain model, run whole
    assert proposed
    with torch.no_grad():
        for tokens, first in proposed[:16]:
            ids = torch.tensor([tokens])
            hidden = model(ids, return_hidden=True)
            mtp = model.mtp_hidden(0, hidden[:, :-1], ids[:, 1:])
            assert model.logits(mtp[0, -1]).argmax().item() == first


def test_the_mtp_latent_cache_comes_out_of_kv_cache_memory_beside_the_targets(with_mtp):
    _, export = with_mtp
    budget = 64 * 1024
    alone = make_engine(export, block_size=8, max_model_len=48, kv_cache_memory=budget)
    engine = make_engine(export, block_size=8, max_model_len=48, kv_cache_memory=budget,
                         speculative=SpeculativeConfig(method="mtp", num_speculative_tokens=2))
    assert_kv_and_drafter_caches_fill_the_budget(engine, budget)
    layers, depth = alone.loaded.config.num_layers, alone.loaded.config.mtp.depth
    assert engine.blocks.num_blocks == alone.runner.num_blocks * layers // (layers + depth)


def test_mtp_speculation_on_a_model_without_mtp_modules_is_refused_in_one_line(exports):
    from tessera.common.errors import UserError

    _, export = exports("q-lora")
    with pytest.raises(UserError, match=r"method mtp: this model has no multi-token-prediction modules"):
        make_engine(export, block_size=8, num_kv_blocks=16, max_model_len=48,
                    speculative=SpeculativeConfig(method="mtp", num_speculative_tokens=2))


def test_greedy_mtp_drafts_chained_in_one_call_equal_the_drafts_drawn_one_forward_at_a_time(with_mtp, monkeypatch):
    """k = 3, greedy: the proposer chains the drafts in one call (MTPDrafter.draft_chain: one round
    trip under tensor parallel); forced one forward at a time (as for a row that penalties or
    logit_bias change), the drafts and the output are the same."""
    from tessera.inference.spec_decode import mtp
    from tessera.inference.worker.latent.mtp import MTPDrafter

    _, export = with_mtp
    requests = {str(i): (p, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
                for i, p in enumerate(_prompts(3, 14))}
    chains, forwards = [], []  # draft_chain calls; every MTP forward's (positions, logits)
    chain, draft = MTPDrafter.draft_chain, MTPDrafter.draft
    monkeypatch.setattr(MTPDrafter, "draft_chain", lambda self, *a: chains.append(1) or chain(self, *a))

    def spy_draft(self, ops, drop, batch, *rest):
        logits = draft(self, ops, drop, batch, *rest)
        forwards.append(([(b.start, b.num_new) for b in batch], logits))
        return logits
    monkeypatch.setattr(MTPDrafter, "draft", spy_draft)
    drafts = record_drafts(monkeypatch)
    runs = []
    for forced in (False, True):
        if forced:
            monkeypatch.setattr(mtp, "needs_processing", lambda seq: True)
        engine = make_engine(export, block_size=8, num_kv_blocks=16, max_model_len=48, enable_prefix_caching=False,
                             speculative=SpeculativeConfig(method="mtp", num_speculative_tokens=3))
        got = {rid: token_ids(o) for rid, o in run_all(engine, requests).items()}
        runs.append((got, list(drafts), len(chains), list(forwards)))
        drafts.clear()
        forwards.clear()
    (chained, chained_drafts, calls, chained_fw), (stepwise, stepwise_drafts, calls_after, stepwise_fw) = runs
    assert calls > 0 and calls_after == calls  # the second run never chained
    assert any(len(d) == 3 for _, d in chained_drafts)
    assert chained == stepwise and chained_drafts == stepwise_drafts
    assert [p for p, _ in chained_fw] == [p for p, _ in stepwise_fw]  # the same positions, the same rows
    for (_, a), (_, b) in zip(chained_fw, stepwise_fw):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
