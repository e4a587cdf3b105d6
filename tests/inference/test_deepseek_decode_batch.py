"""DeepSeek-V3-class (multi-head latent attention) decode steps through the persistent decode batch
(batch.DecodeBatch) and the bucket-padded forward CUDA graphs replay (cuda_graphs.py; run uncaptured
here, `--padded-decode`): outputs, greedy and seeded-sampled, equal the eager engine's with batches
padded to a bucket, preemption and prefix-cache hits; padding rows write only the scratch block;
`--async-scheduling` gives the synchronous outputs; MTP drafts after plain decode steps (eager,
padded) still read the target's hidden rows of those steps, and after a step that raised past its
forward, never that step's. The gpu test captures and replays."""

from __future__ import annotations

import os

import pytest
import torch
from deepseek_hf import build_hf
from inference_helpers import hf_greedy, make_engine, run_all, token_ids
from test_async_scheduling import _run, _same
from test_cuda_graphs import assert_same, kernel_matches_reference, outputs, requests_of
from test_deepseek_serving import MODELS, _prompts, mtp_export
from test_hf_serving import _save

from tessera.inference.core.sampling_params import SamplingParams
from tessera.inference.worker.batch import BatchSeq
from tessera.kernels._dispatch import triton_available

SIZES = [1, 4]  # 3 (and 2) running sequences pad to 4


@pytest.fixture(scope="module")
def export(tiny_ckpt, tmp_path_factory):
    hf = build_hf(**MODELS["no-q-lora-yarn"])
    with torch.no_grad():  # well-separated greedy choices
        hf.get_output_embeddings().weight.mul_(8.0)
    return _save(hf, tiny_ckpt, tmp_path_factory.mktemp("hf") / "deepseek")


def _engines(export, **over):
    """(eager engine, padded-decode engine): up to 4 sequences at once in 9 blocks of 8 tokens (fewer
    than they need: preemption), prefix caching on."""
    cfg = dict(block_size=8, num_kv_blocks=9, max_model_len=48, max_num_seqs=4, max_num_batched_tokens=32, seed=0,
               **over)
    return make_engine(export, **cfg), make_engine(export, padded_decode=True, cuda_graph_sizes=SIZES, **cfg)


def workload(sampled: bool) -> dict[str, tuple[list[int], SamplingParams]]:
    """Five requests, up to four running at a time, fewer as they finish or are preempted (3 and 2:
    bucket 4); the first four share a 17-token prefix (two whole blocks, cached for the later ones)."""
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(3, 500, (17,), generator=g).tolist()
    prompts = [shared + [5], shared + [6, 7], shared + [8], shared + [9, 10, 11],
               torch.randint(3, 500, (9,), generator=g).tolist()]
    return requests_of(prompts, (14, 18, 9, 16, 12), sampled)


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded-sampled"])
def test_padded_decode_gives_the_eager_engines_outputs_with_preemption_and_prefix_hits(export, sampled):
    eager, padded = _engines(export)
    assert type(padded.runner).keeps_decode_batch()
    graphs, rows = padded.runner.decode_graphs, []
    forward_step = graphs.forward_step
    graphs.forward_step = lambda step, size: rows.append((step.seq_lens.shape[0], size)) or forward_step(step, size)
    requests = workload(sampled)
    assert_same(outputs(padded, requests), outputs(eager, requests))
    assert {(3, 4), (1, 1)} <= set(rows)  # decode-batch steps of 3 sequences padded to 4; one alone
    for engine in (padded, eager):
        assert engine.scheduler.num_preemptions > 0 and engine.blocks.prefix_hits > 0
        assert engine.blocks.num_used == 0


def test_padded_decode_over_an_fp8_latent_cache_equals_eager_fp8(export):
    eager, padded = _engines(export, kv_cache_dtype="fp8")
    assert padded.runner.kv.dtype == torch.float8_e4m3fn
    requests = workload(sampled=False)
    assert_same(outputs(padded, requests), outputs(eager, requests))
    assert padded.runner.decode_graphs.replays[4] > 0


def test_padding_rows_write_only_the_scratch_block_and_the_logits_equal_the_unpadded_steps(export):
    _, padded = _engines(export)
    runner, graphs = padded.runner, padded.runner.decode_graphs
    with torch.no_grad():
        runner.kv.copy_(torch.randn(runner.kv.shape, generator=torch.Generator().manual_seed(0)))
    # Three decoding sequences (bucket 4); lengths 5, 13 and 20 after this token.
    batch = [BatchSeq([11], 4, [7], 1), BatchSeq([12], 12, [3, 5], 1), BatchSeq([13], 19, [2, 4, 6], 1)]
    before = runner.kv.clone()
    with torch.inference_mode():
        padded_logits = runner.forward_batch(batch, [0, 1, 2])
        changed = (runner.kv != before).any(dim=(0, 3, 4))  # [block, slot]
        after = runner.kv.clone()
        runner.kv.copy_(before)
        runner.decode_graphs = None  # the unpadded step, through the CPU decode groups
        try:
            eager_logits = runner.forward_batch(batch, [0, 1, 2])
        finally:
            runner.decode_graphs = graphs
    written = {(7, 4), (5, 4), (6, 3)}  # each new token's (block, slot)
    assert {tuple(x) for x in changed.nonzero().tolist()} == written | {(graphs.scratch, 0)}
    pool = slice(0, graphs.scratch)
    # The same latents as the unpadded step wrote (to GEMM rounding: another batch shape)
    assert (after[:, pool] - runner.kv[:, pool]).norm() / runner.kv[:, pool].norm() < 1e-6
    assert ((padded_logits - eager_logits).norm() / eager_logits.norm()) < 1e-5


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" or not triton_available(),
                    reason="needs Triton's interpreter (TRITON_INTERPRET=1, as make test sets)")
def test_the_padded_latent_step_through_the_triton_kernel_equals_the_reference(export, monkeypatch):
    """What a captured graph runs on CUDA: absorbed queries over the latent pool through the Triton
    paged-attention kernel, its tables padded to max_model_len / block_size, padding rows on the
    scratch block."""
    _, padded = _engines(export)
    kernel_matches_reference(padded.runner, [[7], [3, 5], [2, 4, 6]], monkeypatch)
    assert padded.runner.decode_graphs.block_tables.shape[1] == 48 // 8  # max_model_len / block_size


def test_async_scheduling_gives_the_synchronous_outputs(export):
    """test_async_scheduling's workload (14 requests of mixed sampling, stops, penalties, prompt
    logprobs, prompts in chunks beside decodes) with preemption, then through the padded forward."""
    outs, launched, preemptions, _, steps = _run(export, True, 24)
    reference, _, ref_preemptions, _, _ = _run(export, False, 24)
    _same(outs, reference)
    assert preemptions > 0 and ref_preemptions > 0
    assert len(launched) > steps / 2  # decode steps fed the tokens of the step in flight
    padded, *_ = _run(export, True, 200, enforce_eager=False, padded_decode=True, cuda_graph_sizes=[1, 2, 4, 8])
    _same(padded, _run(export, False, 200)[0])


@pytest.mark.parametrize("padded", [False, True], ids=["eager", "padded"])
def test_mtp_drafts_after_plain_decode_steps_read_those_steps_hidden_rows(tiny_ckpt, tmp_path, monkeypatch, padded):
    """Two steps in three draft nothing (num_drafts_for patched), so they are plain decode steps (the
    decode batch; padded: their hidden rows copied out of the static buffer); each first draft's MTP
    logits are still those over the target's hidden states of the sequence, run whole."""
    from tessera.inference.config import SpeculativeConfig
    from tessera.inference.spec_decode import mtp
    from tessera.inference.spec_decode.proposers import MTPProposer
    from tessera.inference.worker.latent.mtp import MTPDrafter
    from tessera.inference.worker.latent.runner import LatentRunner

    hf, export = mtp_export(tiny_ckpt, tmp_path / "mtp")
    proposed: list[tuple[list[int], torch.Tensor]] = []  # (the sequence's tokens, its first draft's logits)
    rows: dict[str, torch.Tensor] = {}
    calls = []
    propose, drafts_for, draft = MTPProposer.propose, mtp.num_drafts_for, MTPDrafter.draft

    def spy_draft(self, ops, drop, batch, rids, catch_up, logits_rows):
        logits = draft(self, ops, drop, batch, rids, catch_up, logits_rows)
        if catch_up:
            rows.update(zip(rids, logits))
        return logits

    def spy(self, running):
        calls.append(1)
        rows.clear()
        propose(self, running)
        proposed.extend((s.tokens(0, s.num_tokens), rows[s.request_id]) for s in running if s.spec_token_ids)
    monkeypatch.setattr(MTPDrafter, "draft", spy_draft)
    monkeypatch.setattr(MTPProposer, "propose", spy)
    # Two plain steps, then one that drafts: the rows of both plain steps wait for the same catch-up.
    monkeypatch.setattr(mtp, "num_drafts_for", lambda seq, k: drafts_for(seq, k) if len(calls) % 3 == 0 else 0)
    plain = []
    single = LatentRunner._execute_single_token
    monkeypatch.setattr(LatentRunner, "_execute_single_token", lambda self, plan: plain.append(1) or single(self, plan))
    graphs = dict(padded_decode=True, cuda_graph_sizes=SIZES) if padded else {}
    engine = make_engine(export, block_size=8, num_kv_blocks=24, max_model_len=48, max_num_batched_tokens=32,
                         max_num_seqs=16, enable_prefix_caching=False,
                         speculative=SpeculativeConfig(method="mtp", num_speculative_tokens=2), **graphs)
    prompts = _prompts(3, 14)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    got = run_all(engine, {str(i): (p, params) for i, p in enumerate(prompts)})
    for i, p in enumerate(prompts):
        assert token_ids(got[str(i)]) == hf_greedy(hf, p, 12), i
    assert len(plain) >= 4 and len(proposed) >= 6
    if padded:
        assert sum(engine.runner.decode_graphs.replays.values()) >= len(plain)
    assert_first_drafts_read_the_model_run_whole(export, proposed)


def assert_first_drafts_read_the_model_run_whole(export, proposed: list[tuple[list[int], torch.Tensor]]) -> None:
    """Each (tokens, first draft's MTP logits): the MTP depth over the hidden states of the plain
    model run whole over the tokens."""
    from tessera.inference.worker.loader import load_for_serving

    model = load_for_serving(export, torch.device("cpu"), torch.float32).model
    with torch.no_grad():
        for tokens, logits in proposed:
            ids = torch.tensor([tokens])
            hidden = model(ids, return_hidden=True)
            whole = model.logits(model.mtp_hidden(0, hidden[:, :-1], ids[:, 1:])[0, -1]).float()
            assert (logits - whole).norm() / whole.norm() < 1e-5, len(tokens)  # measured: at most 2.3e-7


def test_after_a_step_that_raised_past_its_forward_the_retried_sequences_drafts_read_their_own_hidden_rows(
        tiny_ckpt, tmp_path, monkeypatch):
    """A plan that raises after its layer stack ran (the "bad" request: an error in the head or the
    sampler) is retried one sequence at a time (LLMEngine._execute). Five running sequences exceed
    the largest bucket (4), so the failed step is eager and keeps its hidden rows; the retries of
    single decode rows replay the padded forward. No retry may take the failed step's rows (nor the
    bad request's retry's) as its own: every first draft's MTP logits equal the model's run whole."""
    from tessera.inference.config import SpeculativeConfig
    from tessera.inference.spec_decode import mtp
    from tessera.inference.spec_decode.proposers import MTPProposer
    from tessera.inference.worker.latent.mtp import MTPDrafter

    hf, export = mtp_export(tiny_ckpt, tmp_path / "mtp")
    calls = []
    propose, drafts_for = MTPProposer.propose, mtp.num_drafts_for
    monkeypatch.setattr(MTPProposer, "propose", lambda self, running: calls.append(1) or propose(self, running))
    # Two steps in three draft nothing: plain decode steps of all five sequences (no bucket holds them).
    monkeypatch.setattr(mtp, "num_drafts_for", lambda seq, k: drafts_for(seq, k) if len(calls) % 3 == 0 else 0)
    engine = make_engine(export, block_size=8, num_kv_blocks=40, max_model_len=48, max_num_batched_tokens=32,
                         max_num_seqs=16, enable_prefix_caching=False, padded_decode=True, cuda_graph_sizes=SIZES,
                         speculative=SpeculativeConfig(method="mtp", num_speculative_tokens=2))
    runner = engine.runner
    faults = []

    def raises_after(run, seqs_of):
        def faulty(*args):
            out = run(*args)  # the forward ran (hidden rows kept), then the step fails
            if any(s.request_id == "bad" and len(s.output_ids) >= 3 and not s.spec_token_ids for s in seqs_of(*args)):
                faults.append(1)
                raise RuntimeError("injected fault after the forward")
            return out
        return faulty
    runner.forward = raises_after(runner.forward, lambda plan, rows: plan.seqs)
    runner.decode_logits = raises_after(runner.decode_logits, lambda *a: runner.decode_batch.seqs)
    proposed: list[tuple[list[int], torch.Tensor]] = []
    draft = MTPDrafter.draft

    def spy_draft(self, ops, drop, batch, rids, catch_up, logits_rows):
        logits = draft(self, ops, drop, batch, rids, catch_up, logits_rows)
        if catch_up:
            seqs = {s.request_id: s for s in engine.scheduler.running}
            proposed.extend((seqs[r].tokens(0, seqs[r].num_tokens), row) for r, row in zip(rids, logits))
        return logits
    monkeypatch.setattr(MTPDrafter, "draft", spy_draft)
    prompts = _prompts(5, 12)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    names = ["bad", "1", "2", "3", "4"]
    got = run_all(engine, {name: (p, params) for name, p in zip(names, prompts)})
    assert faults and got["bad"][-1].error
    for name, p in zip(names[1:], prompts[1:]):
        assert token_ids(got[name]) == hf_greedy(hf, p, 10), name
    assert runner.decode_graphs.replays[1] > 0 and len(proposed) >= 8  # the retries replayed bucket 1
    # (Taking the failed step's first row as sequence "1"'s was 4.4e-4 off in the draft after it.)
    assert_first_drafts_read_the_model_run_whole(export, proposed)


def test_a_mixture_of_experts_config_whose_layers_are_all_dense_can_be_captured():
    """What the gpu test below serves: a DeepSeek-V3 config (moe present) whose every layer keeps its
    dense MLP reads no expert counts back; one MoE layer makes the model uncapturable."""
    from inference_helpers import tiny_config

    from tessera.inference.worker.cuda_graphs import uncapturable

    moe = dict(num_experts=4, top_k=2, ffn_hidden_size=16)
    assert uncapturable(tiny_config(moe=dict(moe, first_k_dense=2))) is None
    assert "mixture-of-experts" in uncapturable(tiny_config(moe=dict(moe, first_k_dense=1)))



def test_models_with_moe_layers_still_decode_uncaptured_and_warn_under_async_scheduling(export):
    """Mixtral, Qwen3-MoE (its first layer dense) and the DeepSeek-V3 export (a dense layer, then
    MoE): on CUDA decode steps stay eager by default, --cuda-graph-sizes is refused in one line and
    --async-scheduling names the expert counts read back; their all-dense twins are capturable."""
    from inference_helpers import tiny_config

    from tessera.common.errors import UserError
    from tessera.inference.config import EngineConfig
    from tessera.inference.engine.llm_engine import _forward_reads_back
    from tessera.inference.worker.cuda_graphs import check_cuda_graphs, decode_graph_mode
    from tessera.inference.worker.loader import load_for_serving

    cuda = torch.device("cuda")  # the decisions read the device's type only
    moe = dict(num_experts=4, top_k=2, ffn_hidden_size=16)
    deepseek = load_for_serving(export, torch.device("cpu"), torch.float32).config
    assert deepseek.mla is not None and deepseek.moe.first_k_dense == 1
    for cfg in (tiny_config(arch="mixtral", moe=moe), tiny_config(arch="qwen3_moe", moe=dict(moe, first_k_dense=1)),
                deepseek):
        assert decode_graph_mode(EngineConfig(), cuda, cfg) == "off", cfg.arch
        with pytest.raises(UserError, match=r"--cuda-graph-sizes: this model cannot be captured \(the mixture-of-exp"):
            check_cuda_graphs(EngineConfig(cuda_graph_sizes=[1, 2]), cuda, cfg)
        assert "experts' token counts" in _forward_reads_back(cfg), cfg.arch
        dense = cfg.model_copy(update={"moe": cfg.moe.model_copy(update={"first_k_dense": cfg.num_layers})})
        assert decode_graph_mode(EngineConfig(), cuda, dense) == "capture" and _forward_reads_back(dense) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_captured_latent_decode_graphs_replay_the_eager_outputs(tiny_ckpt, tmp_path):
    """An all-dense DeepSeek-V3 (first_k_dense_replace = layers: MoE layers read expert counts back and
    are never captured): CUDA graphs of buckets 1 and 4 captured, replayed for 3 running sequences, and
    the outputs equal the eager CUDA engine's; padding rows attend over the scratch block."""
    from tessera.inference.config import EngineConfig
    from tessera.inference.engine.llm_engine import LLMEngine
    from tessera.inference.worker.loader import load_for_serving

    hf = build_hf(**MODELS["q-lora"], first_k_dense_replace=2)
    with torch.no_grad():
        hf.get_output_embeddings().weight.mul_(8.0)
    export = _save(hf, tiny_ckpt, tmp_path / "dense")
    dev = torch.device("cuda")

    def engine(**over):
        cfg = EngineConfig(device="cuda", block_size=8, num_kv_blocks=32, max_model_len=48, max_num_seqs=4,
                           max_num_batched_tokens=32, seed=0, **over)
        return LLMEngine(load_for_serving(export, dev, torch.float32), cfg, dev, torch.float32)
    captured = engine(cuda_graph_sizes=SIZES)
    graphs = captured.runner.decode_graphs
    assert graphs is not None and graphs.capture and set(graphs.graphs) == set(SIZES)
    requests = workload(sampled=False) | {f"s{k}": v for k, v in workload(sampled=True).items()}
    assert_same(outputs(captured, requests), outputs(engine(enforce_eager=True), requests))
    assert graphs.replays[4] > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_mtp_drafts_after_replayed_plain_steps_equal_the_eager_engines(tiny_ckpt, tmp_path, monkeypatch):
    """The same all-dense target with an MTP depth: two steps in three draft nothing, so they replay
    a captured graph, whose hidden rows the MTP reads from the static buffer written inside it; the
    drafts and tokens equal the eager CUDA engine's."""
    from deepseek_hf import save_with_mtp
    from test_deepseek_serving import record_drafts

    from tessera.inference.config import EngineConfig, SpeculativeConfig
    from tessera.inference.engine.llm_engine import LLMEngine
    from tessera.inference.spec_decode import mtp
    from tessera.inference.spec_decode.proposers import MTPProposer
    from tessera.inference.worker.loader import load_for_serving

    hf = build_hf(**MODELS["q-lora"], first_k_dense_replace=2)
    with torch.no_grad():
        hf.get_output_embeddings().weight.mul_(8.0)
    export = _save(hf, tiny_ckpt, tmp_path / "dense-mtp")
    save_with_mtp(hf, export)
    calls = []
    propose, drafts_for = MTPProposer.propose, mtp.num_drafts_for
    monkeypatch.setattr(MTPProposer, "propose", lambda self, running: calls.append(1) or propose(self, running))
    monkeypatch.setattr(mtp, "num_drafts_for", lambda seq, k: drafts_for(seq, k) if len(calls) % 3 == 0 else 0)
    drafts = record_drafts(monkeypatch)
    dev = torch.device("cuda")
    requests = {str(i): (p, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
                for i, p in enumerate(_prompts(3, 14))}
    runs = []
    for over in (dict(cuda_graph_sizes=SIZES), dict(enforce_eager=True)):
        calls.clear()
        drafts.clear()
        cfg = EngineConfig(device="cuda", block_size=8, num_kv_blocks=24, max_model_len=48, max_num_seqs=4,
                           max_num_batched_tokens=32, enable_prefix_caching=False,
                           speculative=SpeculativeConfig(method="mtp", num_speculative_tokens=2), **over)
        engine = LLMEngine(load_for_serving(export, dev, torch.float32), cfg, dev, torch.float32)
        runs.append(({rid: token_ids(o) for rid, o in run_all(engine, requests).items()}, list(drafts),
                     engine.runner.decode_graphs))
    (captured, captured_drafts, graphs), (eager, eager_drafts, _) = runs
    assert graphs is not None and graphs.capture and sum(graphs.replays.values()) > 0
    assert len(eager_drafts) >= 6 and captured == eager and captured_drafts == eager_drafts
