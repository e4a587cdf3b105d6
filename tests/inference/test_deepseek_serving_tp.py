"""Tensor-parallel serving of a DeepSeek-V3 model (`--tensor-parallel 2`): two gloo workers, each
holding half the heads of q_b_proj / kv_b_proj / o_proj (the causal LM's plan, split_mla) and the
whole latent KV cache, give transformers' greedy tokens under chunked prefill and preemption; with
MTP drafts (the MTP forward on the workers, spec_decode/mtp.py) the one-process MTP path's drafts
and tokens. Steady decode steps go to the workers as DecodeUpdates (synchronous and async), and
plain steps between MTP drafts keep their hidden rows on the workers through the padded forward."""

from __future__ import annotations

import pytest
import torch
from deepseek_hf import build_hf
from inference_helpers import hf_greedy, run_all, token_ids
from test_async_scheduling import _run, _same
from test_deepseek_serving import MODELS, _prompts, mtp_export, record_drafts
from test_hf_serving import _save

from tessera.common.errors import UserError
from tessera.common.tokenizer import load_tokenizer
from tessera.inference.config import EngineConfig, SpeculativeConfig
from tessera.inference.core.sampling_params import SamplingParams
from tessera.inference.engine.llm_engine import LLMEngine
from tessera.inference.worker.loader import load_for_serving

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

CPU = torch.device("cpu")


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_tp2_serves_a_deepseek_v3_directory_like_transformers_and_refuses_mtp_drafts_without_mtp_modules_in_one_line(
        tiny_ckpt, tmp_path, expert_parallel):
    """With --enable-expert-parallel each rank holds half the routed experts; the shared expert and
    the grouped sigmoid router stay replicated."""
    hf = build_hf(**MODELS["q-lora"])
    with torch.no_grad():
        hf.get_output_embeddings().weight.mul_(8.0)
    export = _save(hf, tiny_ckpt, tmp_path / "hf")
    prompts = _prompts(6, 20)
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    loaded = load_for_serving(export, CPU, torch.float32, tensor_parallel=2)
    engine = LLMEngine(loaded, EngineConfig(tensor_parallel=2, block_size=8, num_kv_blocks=12, max_model_len=48,
                                            max_num_batched_tokens=16, max_num_seqs=8,
                                            enable_expert_parallel=expert_parallel), CPU, torch.float32)
    try:
        assert engine.runner.state_summary().endswith("(3.0x) on each of 2 ranks")  # half the heads' full K/V
        outs = run_all(engine, {str(i): (p, params) for i, p in enumerate(prompts)})
        preempted = engine.scheduler.num_preemptions
    finally:
        engine.close()
    for i, prompt in enumerate(prompts):
        assert token_ids(outs[str(i)]) == hf_greedy(hf, prompt, 5), i
    assert preempted > 0
    with pytest.raises(UserError, match=r"method mtp: this model has no multi-token-prediction modules"):
        LLMEngine(loaded, EngineConfig(tensor_parallel=2, block_size=8, num_kv_blocks=12, max_model_len=48,
                                       speculative=SpeculativeConfig(method="mtp", num_speculative_tokens=1)),
                  CPU, torch.float32)


def test_tp2_mtp_drafts_through_the_openai_client_like_one_process_and_a_worker_dying_in_an_mtp_step_ends_it(
        tiny_ckpt, tmp_path, monkeypatch):
    """`--tensor-parallel 2` with MTP drafts (k = 2): greedy and seeded requests one at a time give
    the one-process MTP path's tokens, drafts, and drafted/accepted counts (the seeded one drawn
    draft by draft on the driver, the greedy one chained on the workers);
    4 concurrent requests with preemption give transformers' greedy tokens (the output without
    speculation). Then a worker killed as an MTP step is sent fails requests and /health."""
    import concurrent.futures as cf
    import os
    import signal

    import httpx
    from inference_helpers import make_engine
    from live_server import LiveServer
    from openai import OpenAI

    from tessera.inference.spec_decode.mtp import TensorParallelMTP

    hf, export = mtp_export(tiny_ckpt, tmp_path / "mtp")
    tok = load_tokenizer(export)
    spec = SpeculativeConfig(method="mtp", num_speculative_tokens=2)
    cfg = dict(block_size=8, max_model_len=48, max_num_batched_tokens=16, max_num_seqs=16,
               enable_prefix_caching=False, speculative=spec)
    prompts = _prompts(4, 14)
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=6, temperature=0.9, seed=7, ignore_eos=True)
    alone = {"g0": (prompts[0], greedy), "s0": (prompts[1], seeded)}
    drafts = record_drafts(monkeypatch)
    one = make_engine(export, num_kv_blocks=10, **cfg)
    expected = {rid: token_ids(run_all(one, {rid: req})[rid]) for rid, req in alone.items()}  # one at a time
    counts = one.stats().spec_num_draft_tokens, one.stats().spec_num_accepted_tokens
    one_drafts = list(drafts)
    assert counts[0] > 0 and drafts
    drafts.clear()
    server = LiveServer(export, tensor_parallel=2, num_kv_blocks=10, **cfg)
    try:
        client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)

        def complete(prompt, params):
            extra = {"ignore_eos": True} | ({"seed": params.seed} if params.seed is not None else {})
            return client.completions.create(model="tiny", prompt=prompt, max_tokens=params.max_tokens,
                                             temperature=params.temperature, extra_body=extra).choices[0].text
        for rid, (prompt, params) in alone.items():
            assert complete(prompt, params) == tok.decode(expected[rid]), rid
        stats = server.engine.stats()
        assert (stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens) == counts and drafts == one_drafts
        # Greedy drafts are chained on the workers: one MTP round trip per step (2 with the target's).
        mtp = server.engine.proposer.mtp
        assert isinstance(mtp, TensorParallelMTP)
        sent, per_step = [], []  # MTP commands awaiting a reply; how many each step sent
        for name in ("draft", "draft_chain"):
            monkeypatch.setattr(mtp, name, lambda *a, f=getattr(mtp, name), n=name: sent.append(n) or f(*a))
        propose = server.engine.proposer.propose

        def counted(running):
            before = len(sent)
            propose(running)
            per_step.append(len(sent) - before)
        monkeypatch.setattr(server.engine.proposer, "propose", counted)
        with cf.ThreadPoolExecutor(len(prompts)) as pool:
            texts = list(pool.map(lambda p: complete(p, greedy), prompts))
        assert texts == [tok.decode(hf_greedy(hf, p, greedy.max_tokens)) for p in prompts]
        assert server.engine.scheduler.num_preemptions > 0 and server.wait_idle()
        assert "draft_chain" in sent and max(per_step) == 1
        for name in ("draft", "draft_chain"):  # rank 1 killed as the MTP command goes out

            def kill_then_send(*a, f=getattr(mtp, name)):
                os.kill(mtp.executor.procs[1].pid, signal.SIGKILL)
                return f(*a)
            monkeypatch.setattr(mtp, name, kill_then_send)
        r = httpx.post(server.url + "/v1/completions", json={"prompt": prompts[0], "max_tokens": 4}, timeout=60)
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error", r.text
        assert httpx.get(server.url + "/health", timeout=10).status_code == 503
    finally:
        server.stop()


@pytest.fixture(scope="module")
def deepseek_export(tiny_ckpt, tmp_path_factory):
    hf = build_hf(**MODELS["no-q-lora-yarn"])
    with torch.no_grad():
        hf.get_output_embeddings().weight.mul_(8.0)
    return _save(hf, tiny_ckpt, tmp_path_factory.mktemp("hf") / "deepseek")


def test_tp2_latent_decode_steps_sent_as_updates_give_one_process_outputs_synchronous_and_async(deepseek_export,
                                                                                                  monkeypatch):
    """test_async_scheduling's workload (mixed sampling, prompts in chunks beside decodes, preemption in
    24 blocks of 4 tokens, r4 aborted mid-way, overlapped: while a row of it is in flight): the workers'
    latent runners keep the persistent decode batch, so steady decode steps go as DecodeUpdates (no
    block table), synchronous and overlapped."""
    from tessera.inference.worker.tensor_parallel.executor import TensorParallelExecutor

    updates = []
    send = TensorParallelExecutor.send_decode
    monkeypatch.setattr(TensorParallelExecutor, "send_decode", lambda self, u: updates.append(u) or send(self, u))
    reference, _, ref_preemptions, ref_aborted, _ = _run(deepseek_export, False, 24, abort_after=9)
    outs, _, preemptions, aborted, _ = _run(deepseek_export, False, 24, abort_after=9, tensor_parallel=2)
    _same(outs, reference)
    assert (preemptions, aborted) == (ref_preemptions, ref_aborted) and preemptions > 0
    assert any(u.src is None and not u.whole for u in updates)  # steady steps: no block table sent
    updates.clear()
    overlapped, launched, _, aborted, _ = _run(deepseek_export, True, 24, abort_after=9, tensor_parallel=2)
    one, _, _, one_aborted, _ = _run(deepseek_export, True, 24, abort_after=9)  # aborted with a row in flight
    _same(overlapped, one)
    assert launched and updates and aborted == one_aborted > 0


def test_tp2_mtp_with_padded_decode_steps_between_drafts_gives_the_one_process_drafts(tiny_ckpt, tmp_path,
                                                                                       monkeypatch):
    """Two steps in three draft nothing: under tensor parallel those plain steps go as `step` commands
    whose hidden rows each worker keeps, here from its padded forward's static buffer (DecodeGraphs
    replays run no Python); the drafts and tokens are the one-process engine's without padding."""
    from inference_helpers import make_engine

    from tessera.inference.spec_decode import mtp
    from tessera.inference.spec_decode.proposers import MTPProposer

    _, export = mtp_export(tiny_ckpt, tmp_path / "mtp")
    calls = []
    propose, drafts_for = MTPProposer.propose, mtp.num_drafts_for
    monkeypatch.setattr(MTPProposer, "propose", lambda self, running: calls.append(1) or propose(self, running))
    monkeypatch.setattr(mtp, "num_drafts_for", lambda seq, k: drafts_for(seq, k) if len(calls) % 3 == 0 else 0)
    drafts = record_drafts(monkeypatch)
    cfg = dict(block_size=8, num_kv_blocks=24, max_model_len=48, max_num_batched_tokens=32, max_num_seqs=16,
               enable_prefix_caching=False, speculative=SpeculativeConfig(method="mtp", num_speculative_tokens=2))
    requests = {str(i): (p, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
                for i, p in enumerate(_prompts(3, 14))}
    one = {rid: token_ids(o) for rid, o in run_all(make_engine(export, **cfg), requests).items()}
    one_drafts = list(drafts)
    drafts.clear()
    calls.clear()
    engine = make_engine(export, tensor_parallel=2, padded_decode=True, cuda_graph_sizes=[1, 4], **cfg)
    try:
        tp = {rid: token_ids(o) for rid, o in run_all(engine, requests).items()}
    finally:
        engine.close()
    assert len(one_drafts) >= 6 and tp == one and drafts == one_drafts
