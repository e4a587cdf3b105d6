"""Serving hybrid models (Mamba-2 layers beside attention, MLP and MoE) from directories transformers
saved: greedy completions over HTTP equal transformers' `generate` for 32 concurrent requests whose
long prompts are prefilled in chunks, with a KV cache small enough to force preemption; the state
pool of the Mamba layers stays the same size whatever the sequences' lengths; the engine settings
that cannot work for them are refused in one line."""

from __future__ import annotations

import concurrent.futures as cf
import logging

import httpx
import pytest
import torch
from inference_helpers import hf_greedy, make_engine, run_all, token_ids, wait_for_health
from live_server import LiveServer
from ports import SERVE, start_serve
from test_hf_serving import _save

from tessera.common.checkpoint import (
    CheckpointSidecar,
    finalize_checkpoint,
    save_model_tensors,
    write_pointer,
)
from tessera.common.errors import UserError
from tessera.common.hf.directory import load_hf_weights, read_hf_config
from tessera.common.tokenizer import load_tokenizer
from tessera.inference.core.sampling_params import SamplingParams
from tessera.inference.worker.state.pool import state_bytes_per_sequence

VOCAB = 512  # the tiny tokenizer's
NEMOTRON_H = dict(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  intermediate_size=48, ssm_state_size=8, mamba_num_heads=4, mamba_head_dim=16, n_groups=2,
                  chunk_size=8, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                  moe_shared_expert_intermediate_size=24, n_group=2, topk_group=1, routed_scaling_factor=2.0,
                  layers_block_type=["linear_attention", "mlp", "full_attention", "moe", "linear_attention"])  # M-*EM
MAMBA2 = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, state_size=8, num_heads=4, head_dim=16,
              n_groups=2, expand=2, chunk_size=8)


def hf_model(family: str):
    """A random tiny transformers model with informative norms and D (transformers sets them to
    constants), steps and decays that make the scan's state weigh in the output (at the default
    initialisation it is ~1e-5 beside the skip connection, so a lost state would go unseen), and
    a scaled head, so that greedy choices are well separated."""
    import transformers

    torch.manual_seed(0)
    if family == "nemotron_h":
        model = transformers.NemotronHForCausalLM(transformers.NemotronHConfig(**NEMOTRON_H))
    else:
        model = transformers.Mamba2ForCausalLM(transformers.Mamba2Config(**MAMBA2))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "norm_f.weight")):
                p.normal_(1.0, 0.5)
            elif name.endswith(".D"):
                p.normal_(0.0, 0.1)
            elif name.endswith("dt_bias"):  # steps of about 0.5-1 ...
                p.normal_(0.5, 0.3)
            elif name.endswith("A_log"):  # ... and slow decay (|A| 0.05-0.37): the scan's state carries far
                p.uniform_(-3.0, -1.0)
            elif "mixer.in_proj" in name or "mixer.conv1d" in name:  # x, B and C of order 1, not 0.02
                p.mul_(10.0 if "in_proj" in name else 25.0)
        model.get_output_embeddings().weight.mul_(20.0)
    return model.eval()


@pytest.fixture(scope="module")
def exports(tiny_ckpt, tmp_path_factory):
    """family -> (family, transformers model, its saved directory with the tiny tokenizer), made once."""
    made = {}

    def get(family: str):
        if family not in made:
            hf = hf_model(family)
            made[family] = family, hf, _save(hf, tiny_ckpt, tmp_path_factory.mktemp("hf") / family)
        return made[family]
    return get


@pytest.fixture(scope="module", params=["nemotron_h", "mamba2"])
def hybrid(request, exports):
    return exports(request.param)


def test_concurrent_long_prompts_with_chunked_prefill_and_preemption_equal_transformers_generate(hybrid):
    """32 requests at once over HTTP; prompts of 30 to 61 tokens are prefilled 32 tokens per step
    (chunks cut mid scan-chunk), decodes share steps with other requests' prefill chunks, and 12
    blocks of 8 tokens hold fewer sequences than run, so some are preempted and recomputed."""
    family, hf, export = hybrid
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, VOCAB, (30 + i,), generator=gen).tolist() for i in range(32)]
    expected = [hf_greedy(hf, p, 6) for p in prompts]
    tokenizer = load_tokenizer(export)
    s = LiveServer(export, block_size=8, num_kv_blocks=12, max_model_len=80, max_num_batched_tokens=32,
                   max_num_seqs=32)
    try:
        body = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
        with cf.ThreadPoolExecutor(32) as pool:
            futs = [pool.submit(httpx.post, f"{s.url}/v1/completions", json={**body, "prompt": p}, timeout=120)
                    for p in prompts]
            replies = [f.result() for f in futs]
        for prompt, reply, want in zip(prompts, replies, expected):
            assert reply.status_code == 200, reply.text
            assert reply.json()["choices"][0]["text"] == tokenizer.decode(want), (family, prompt)
        assert s.engine.scheduler.num_preemptions > 0
        assert s.wait_idle()
        assert len(s.engine.blocks.free_slots) == 32  # every state slot came back
    finally:
        s.stop()


def test_the_state_pool_does_not_grow_with_sequence_length_and_the_startup_summary_says_its_size(hybrid):
    family, _, export = hybrid
    engine = make_engine(export, block_size=8, num_kv_blocks=64, max_model_len=256, max_num_seqs=3)
    pool = engine.runner.states
    before = pool.nbytes
    per_seq = state_bytes_per_sequence(engine.loaded.config, torch.float32)
    assert before == 3 * per_seq > 0
    for length in (5, 200):
        engine.add_request(f"r{length}", [7] * length, SamplingParams(max_tokens=2, ignore_eos=True))
        engine.run_to_completion(lambda _: None)
        assert pool.nbytes == before
    assert engine.runner.state_summary().startswith(f"state pool 3 sequences x {per_seq / 1024:.1f} KiB")


def test_prefix_caching_is_switched_off_for_hybrid_models_in_one_line(hybrid, caplog):
    """A warning (the engine process logs warnings), unless --no-prefix-caching asked for it off."""
    family, _, export = hybrid
    for asked in (True, False):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="tessera.inference"):
            engine = make_engine(export, block_size=8, num_kv_blocks=64, max_model_len=256,
                                 enable_prefix_caching=asked)
        assert not engine.blocks.enable_prefix_caching
        said = [r for r in caplog.records if "prefix caching: off for this hybrid model" in r.message]
        assert len(said) == asked and all(r.levelno == logging.WARNING for r in said)


@pytest.mark.parametrize("cfg, message", [
    ({"speculative": {"method": "ngram", "num_speculative_tokens": 2}}, "--speculative-config: model kind 'hybrid'"),
    ({"cpu_compile": True}, r"cpu_compile: model cannot be compiled \(the hybrid stack runs its Mamba layers"),
])
def test_engine_settings_hybrid_models_cannot_honour_are_refused_naming_the_flag(hybrid, cfg, message):
    with pytest.raises(UserError, match=message):
        make_engine(hybrid[2], block_size=8, num_kv_blocks=64, max_model_len=256, **cfg)


def test_a_tessera_checkpoint_of_the_hybrid_model_is_served_like_transformers_generate(hybrid, tmp_path):
    """The same weights imported into a Tessera checkpoint (DCP + sidecar + tokenizer) serve the
    same greedy tokens as transformers' model."""
    family, hf, export = hybrid
    cfg, _ = read_hf_config(export)
    it = tmp_path / "run" / "checkpoints" / "iter_0000001"
    it.mkdir(parents=True)
    save_model_tensors(it, load_hf_weights(export, cfg))
    load_tokenizer(export).save(it / "tokenizer")
    finalize_checkpoint(it, CheckpointSidecar(model=cfg, step=1))
    write_pointer(it.parent, 1)
    engine = make_engine(tmp_path / "run", block_size=8, num_kv_blocks=64, max_model_len=256,
                         max_num_batched_tokens=32, max_num_seqs=4)
    prompts = {"a": list(range(40, 85)), "b": [9, 300, 2, 77, 5]}
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    outs = run_all(engine, {rid: (p, params) for rid, p in prompts.items()})
    for rid, prompt in prompts.items():
        assert token_ids(outs[rid]) == hf_greedy(hf, prompt, 8), (family, rid)


def test_tessera_serve_states_the_state_pool_in_its_startup_line_and_serves_completions(exports):
    """The real CLI (engine in its own process): the startup line says how many sequences the state
    pool holds and each one's bytes, one line before it says prefix caching is off, and a
    completion over HTTP is transformers' greedy output."""
    _, hf, export = exports("nemotron_h")  # one family: a server start is the slow part
    proc, url, lines = start_serve(SERVE, "--checkpoint", export, "--quiet", "--num-kv-blocks", "64",
                                   "--max-model-len", "256", "--max-num-seqs", "4", "--torch-threads", "1")
    try:
        line = lines[-1]
        assert sum("prefix caching: off for this hybrid model" in x for x in lines) == 1, lines
        cfg, _ = read_hf_config(export)
        per_seq = state_bytes_per_sequence(cfg, torch.float32)
        assert f"state pool 4 sequences x {per_seq / 1024:.1f} KiB" in line, line
        wait_for_health(proc, url, 60)
        prompt = list(range(60, 110))
        reply = httpx.post(url + "/v1/completions", timeout=60,
                           json={"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
        assert reply.json()["choices"][0]["text"] == load_tokenizer(export).decode(hf_greedy(hf, prompt, 8))
    finally:
        proc.kill()
        proc.wait()


def test_the_state_pool_comes_out_of_the_kv_cache_memory_and_one_that_fills_it_is_refused_in_one_line(exports):
    """--kv-cache-memory is the budget of both caches: the state pool's max_num_seqs slots first,
    the attention layers' KV blocks from the rest."""
    from tessera.inference.worker.state.runner import hybrid_block_bytes

    export = exports("nemotron_h")[2]
    cfg, _ = read_hf_config(export)
    states = 4 * state_bytes_per_sequence(cfg, torch.float32)
    block = hybrid_block_bytes(cfg, 8, torch.float32)  # one attention layer's K and V for 8 tokens
    engine = make_engine(export, block_size=8, kv_cache_memory=states + 100 * block, max_model_len=64, max_num_seqs=4)
    assert engine.blocks.num_blocks == 100 and engine.runner.states.nbytes == states
    export = exports("mamba2")[2]
    states = 4 * state_bytes_per_sequence(read_hf_config(export)[0], torch.float32)
    with pytest.raises(UserError, match=rf"--kv-cache-memory {states - 1}: the state pool of this hybrid model's "
                                        rf"Mamba layers takes {states} bytes \(4 sequences, --max-num-seqs\)"):
        make_engine(export, block_size=8, kv_cache_memory=states - 1, max_model_len=64, max_num_seqs=4)


def test_an_aborted_sequence_gives_its_state_slot_back_and_the_next_owner_starts_from_a_zero_state(hybrid):
    family, hf, export = hybrid
    engine = make_engine(export, block_size=8, num_kv_blocks=64, max_model_len=128, max_num_seqs=1)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    engine.add_request("a", list(range(100, 140)), params)
    for _ in range(4):  # prefill and a few decode steps: slot 0 holds a's state
        engine.step()
    assert engine.blocks.slots == {"a": 0} and engine.runner.states.layers[0].ssm.abs().max() > 0.1
    engine.abort("a")
    assert engine.blocks.slots == {} and engine.blocks.free_slots == [0]
    prompt = [9, 300, 2, 77, 5, 61]
    outs = run_all(engine, {"b": (prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))})
    assert token_ids(outs["b"]) == hf_greedy(hf, prompt, 8), family
