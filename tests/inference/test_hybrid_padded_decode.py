"""Pure decode steps of hybrid models through the bucket-padded forward (state/runner.py,
cuda_graphs.py): on CPU the padded path runs uncaptured, the code a CUDA graph replays.

Buckets [1, 4] with three running sequences pad one row. The padded engine's tokens and logprobs,
greedy and seeded-sampled, equal the eager engine's over a workload with chunked prefill,
preemption (a preempted sequence's state is recomputed) and an abort, for NemotronH (Mamba,
attention, MLP and MoE layers) and Mamba2. A padded decode step that fails after its forward
leaves the state pool as it was, and the engine's retry gives the outputs of a run without the
failure. Padding rows write the scratch slot (the state of token 0 at position 0) and nothing
else. TP2 workers on gloo pad like one eager process. The gpu test captures and replays on CUDA.
"""

from __future__ import annotations

import pytest
import torch
from inference_helpers import make_engine, run_all
from test_cuda_graphs import assert_same, tokens_and_logprobs
from test_hf_serving import _save
from test_hybrid_serving import hf_model

from tessera.common.errors import UserError
from tessera.common.hf.directory import read_hf_config
from tessera.inference.config import EngineConfig
from tessera.inference.core.sampling_params import SamplingParams
from tessera.inference.engine.llm_engine import LLMEngine, _forward_reads_back
from tessera.inference.worker.cuda_graphs import check_cuda_graphs, decode_graph_mode
from tessera.inference.worker.loader import load_for_serving
from tessera.inference.worker.state.pool import state_bytes_per_sequence
from tessera.inference.worker.state.runner import hybrid_block_bytes

SIZES = [1, 4]
ENGINE = dict(block_size=8, num_kv_blocks=12, max_model_len=64, max_num_batched_tokens=16, max_num_seqs=4, seed=0)


@pytest.fixture(scope="module")
def exports(tiny_ckpt, tmp_path_factory):
    """family -> the directory transformers saved its random tiny model to (test_hybrid_serving's), made once."""
    made = {}

    def get(family: str):
        if family not in made:
            made[family] = _save(hf_model(family), tiny_ckpt, tmp_path_factory.mktemp("hf") / family)
        return made[family]
    return get


def engine(export, padded: bool, **over):
    extra = dict(padded_decode=True, cuda_graph_sizes=SIZES) if padded else {}
    return make_engine(export, **{**ENGINE, **extra, **over})


def workload(sampled: bool) -> dict[str, tuple[list[int], SamplingParams]]:
    """Three requests (bucket 4: one padding row) whose prompts of 20 to 29 tokens are prefilled
    16 tokens per step, plus a one-token prompt (a decode row at position 0); 12 blocks of 8 tokens
    cannot hold them all to the end (one is the padding rows' scratch block), so one is preempted."""
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(2, 500, (n,), generator=g).tolist() for n in (20, 29, 24)] + [[7]]
    out = {}
    for i, (prompt, n) in enumerate(zip(prompts, (18, 14, 22, 9))):
        params = (SamplingParams(max_tokens=n, temperature=0.9, top_p=0.95, seed=100 + i, ignore_eos=True, logprobs=0)
                  if sampled else SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=0))
        out[f"r{i}"] = (prompt, params)
    return out


def run(eng, requests, abort: bool = True) -> dict:
    """Each request's tokens and all logprobs in order (key "logprobs"). r1 is aborted six steps in
    (when `abort`), and r3 added two steps later, as a decode row at position 0 that takes the
    lowest free slot: r1's, which still holds r1's state."""
    outs: dict[str, list] = {rid: [] for rid in requests}
    steps = 0
    for rid, (ids, params) in requests.items():
        if rid != "r3":
            eng.add_request(rid, ids, params)
    while eng.has_unfinished() or steps <= 8:
        if steps == 6 and abort:
            eng.abort("r1")
        if steps == 8:
            eng.add_request("r3", *requests["r3"])
        for o in eng.step():
            outs[o.request_id].append(o)
        steps += 1
    return tokens_and_logprobs(outs)


def pool_tensors(eng) -> list[torch.Tensor]:
    return [t.clone() for s in eng.runner.states.layers.values() for t in (*s.conv.values(), s.ssm)]


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded-sampled"])
@pytest.mark.parametrize("family", ["nemotron_h", "mamba2"])
def test_padded_decode_gives_the_eager_engines_outputs(exports, family, sampled):
    export = exports(family)
    eager, padded = engine(export, False), engine(export, True)
    requests = workload(sampled)
    assert_same(run(padded, requests), run(eager, requests))
    assert padded.runner.decode_graphs.replays[4] > 0  # three rows, one padding row
    assert padded.scheduler.num_preemptions > 0


def test_a_padded_decode_step_that_fails_after_its_forward_leaves_the_pool_and_the_retry_gives_the_same_outputs(
        exports, monkeypatch):
    """Sampling raises once, in the first padded step of three rows (its forward has advanced the
    copies): the pool's tensors are those from before the step, and the engine's retry (each
    sequence alone, bucket 1) gives the tokens and logprobs of a run without the failure."""
    export = exports("mamba2")
    requests = workload(sampled=False)
    want = run(engine(export, True), requests, abort=False)
    eng = engine(export, True)
    runner = eng.runner
    execute, sample = runner.execute, runner._sample
    seen: dict = {}

    def failing_sample(out, seqs, logits):
        if not seen and len(seqs) == 3 and runner.decode_graphs.replays[4]:
            seen["failed"] = True
            raise RuntimeError("injected")
        sample(out, seqs, logits)

    def checked_execute(plan):
        before = pool_tensors(eng)
        try:
            return execute(plan)
        except RuntimeError:
            seen["unchanged"] = all(torch.equal(a, b) for a, b in zip(before, pool_tensors(eng)))
            seen["advanced"] = any(not torch.equal(a, b) for a, b in zip(before, (
                t for _, _, s in runner._pending for t in (*s.conv.values(), s.ssm))))
            raise

    monkeypatch.setattr(runner, "_sample", failing_sample)
    monkeypatch.setattr(runner, "execute", checked_execute)
    got = run(eng, requests, abort=False)
    assert seen == {"failed": True, "unchanged": True, "advanced": True}
    assert_same(got, want)


def test_padding_rows_write_the_scratch_slot_and_no_other(exports):
    """Slots no sequence holds are filled with noise first: after the run they are unchanged, and
    the scratch slot holds the state of token 0 at position 0 (what every padding row computes
    from a zero state), as an eager engine leaves it for a one-token prompt [0]."""
    export = exports("mamba2")
    eng = engine(export, True, max_num_seqs=8)
    pool = eng.runner.states
    g = torch.Generator().manual_seed(0)
    unused = torch.arange(4, 8)  # the workload's four sequences take slots 0-3 at most
    for state in pool.layers.values():
        for t in (*state.conv.values(), state.ssm):
            t[unused] = torch.randn(t[unused].shape, generator=g, dtype=t.dtype)
    noise = [t[unused].clone() for s in pool.layers.values() for t in (*s.conv.values(), s.ssm)]
    run(eng, workload(sampled=False))
    assert eng.runner.decode_graphs.replays[4] > 0
    assert all(torch.equal(t[unused], n) for t, n in zip(
        (t for s in pool.layers.values() for t in (*s.conv.values(), s.ssm)), noise))
    ref = engine(export, False, max_num_seqs=8)
    run_all(ref, {"z": ([0], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))})
    assert pool.scratch == 8
    for layer, state in pool.layers.items():
        want = ref.runner.states.layers[layer]
        for got, exp in zip((*state.conv.values(), state.ssm), (*want.conv.values(), want.ssm)):
            assert exp[0].abs().max() > 0  # token 0 leaves a state that is not zero
            torch.testing.assert_close(got[8], exp[0], rtol=1e-5, atol=1e-6)


def test_the_state_copies_of_every_bucket_share_one_buffer_of_the_largest_buckets_rows(exports):
    """The copies a padded forward advances stay alive after it (on CUDA a captured graph's own
    tensors), so one buffer per bucket would hold sum(sizes) sequences' states beside the pool
    (4231 with the default sizes at --max-num-seqs 256): every bucket's copies are rows of one
    buffer of max(sizes) rows, as large as the largest step's copies in the eager path."""
    eng = engine(exports("mamba2"), True)
    run(eng, workload(sampled=False))
    runner = eng.runner
    assert runner.decode_graphs.replays[1] > 0 and runner.decode_graphs.replays[4] > 0
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for states in runner._graph_states.values() for _, s in states for t in (*s.conv.values(), s.ssm)}
    assert sum(storages.values()) == max(SIZES) * runner.state_bytes


def test_with_padded_decode_the_kv_blocks_and_the_state_pool_with_its_scratch_slot_fit_the_kv_cache_memory(exports):
    """--kv-cache-memory is the budget of both caches (test_hybrid_serving); padded decode adds the
    padding rows' scratch slot to the state pool, which comes out of the same budget."""
    export = exports("nemotron_h")
    cfg = read_hf_config(export)[0]
    slot = state_bytes_per_sequence(cfg, torch.float32)
    budget = 4 * slot + 100 * hybrid_block_bytes(cfg, 8, torch.float32)  # the eager engine fills it exactly
    for padded in (False, True):
        extra = dict(padded_decode=True, cuda_graph_sizes=SIZES) if padded else {}
        runner = make_engine(export, block_size=8, kv_cache_memory=budget, max_model_len=64, max_num_seqs=4,
                             **extra).runner
        assert runner.states.nbytes == (4 + padded) * slot
        assert budget - slot < runner.kv.nbytes + runner.states.nbytes <= budget
        assert ("+ 1 scratch slot" in runner.state_summary()) == padded


def test_tp2_workers_pad_hybrid_decode_steps_like_one_eager_process(exports):
    """Each worker pads over its shard and its share of the state pool, and writes its states back
    when its forward returns (state/runner.py)."""
    export = exports("mamba2")
    cpu = torch.device("cpu")
    loaded = load_for_serving(export, cpu, torch.float32, tensor_parallel=2)
    tp2 = LLMEngine(loaded, EngineConfig(tensor_parallel=2, padded_decode=True, cuda_graph_sizes=SIZES, **ENGINE),
                    cpu, torch.float32)
    try:
        got = run(tp2, workload(sampled=False))
    finally:
        tp2.close()
    assert_same(got, run(engine(export, False), workload(sampled=False)))


def test_on_cuda_hybrid_decode_steps_are_captured_when_sizes_are_given_and_moe_is_refused(exports):
    """No GPU needed: the mode and the refusal read the engine config, the device type and the model's."""
    cuda = torch.device("cuda")
    mamba2, nemotron_h = (read_hf_config(exports(f))[0] for f in ("mamba2", "nemotron_h"))
    assert decode_graph_mode(EngineConfig(), cuda, mamba2) == "off"  # not the default until measured on a GPU
    assert decode_graph_mode(EngineConfig(cuda_graph_sizes=[1, 4]), cuda, mamba2) == "capture"
    assert decode_graph_mode(EngineConfig(cuda_graph_sizes=[1, 4]), cuda, nemotron_h) == "off"  # its MoE layer
    with pytest.raises(UserError, match="--cuda-graph-sizes: this model cannot be captured .the mixture-of-experts"):
        check_cuda_graphs(EngineConfig(cuda_graph_sizes=[1, 4]), cuda, nemotron_h)
    check_cuda_graphs(EngineConfig(cuda_graph_sizes=[1, 4]), cuda, mamba2)
    # The async-scheduling warning asks the same question of a hybrid config (which has no is_moe_layer).
    assert _forward_reads_back(nemotron_h) == "its experts' token counts (mixture of experts)"
    assert _forward_reads_back(mamba2) is None


@pytest.mark.gpu
def test_captured_hybrid_decode_graphs_replay_the_eager_engines_outputs(exports):
    """Mamba2 (NemotronH's MoE layers read expert counts back and decode eagerly on CUDA)."""
    export = exports("mamba2")
    dev = torch.device("cuda")

    def build(**over):
        loaded = load_for_serving(export, dev, torch.float32)
        return LLMEngine(loaded, EngineConfig(**ENGINE, device="cuda", dtype="float32", **over), dev, torch.float32)
    eager, graphed = build(enforce_eager=True), build(cuda_graph_sizes=SIZES)
    assert graphed.runner.states.scratch == ENGINE["max_num_seqs"]
    graphs = graphed.runner.decode_graphs
    assert graphs.capture and sorted(graphs.graphs) == SIZES
    for sampled in (False, True):
        assert_same(run(graphed, workload(sampled)), run(eager, workload(sampled)))
    assert graphs.replays[4] > 0 and graphs.replays[1] > 0
