"""Decode steps through bucket-padded CUDA graphs (cuda_graphs.py).

On CPU the padded forward runs without capture (`padded_decode`, the code a graph replays): its
outputs, greedy and seeded-sampled, equal the unpadded eager engine's for Llama (GQA) and GPT-2,
with batches that are and are not bucket sizes and that shrink as requests finish, beside
prefix-cache hits and n-gram speculative steps (which stay eager), and in TP2 workers on gloo; padding
rows write only the scratch block; the Triton kernel (interpreter) over max-blocks-padded tables
equals the reference. Bucket choice, capture sizes and bad flags are checked here too. The gpu
tests capture and replay on CUDA and compare with eager.
"""

from __future__ import annotations

import os

import pytest
import torch
from inference_helpers import make_checkpoint, run_all, tiny_config, token_ids

from tessera.common.errors import UserError, run_cli
from tessera.inference.config import EngineConfig
from tessera.inference.core.sampling_params import SamplingParams
from tessera.inference.worker.batch import BatchSeq
from tessera.inference.worker.cuda_graphs import bucket_for, default_capture_sizes, parse_capture_sizes
from tessera.kernels._dispatch import triton_available

SIZES = [1, 2, 4, 8]
GPT2 = dict(arch="gpt2", num_kv_heads=4, norm="layernorm", activation="gelu", position="learned", bias=True,
            tie_embeddings=True, norm_eps=1e-5)


def build(ckpt, device: str = "cpu", **over):
    from tessera.inference.engine.llm_engine import LLMEngine
    from tessera.inference.worker.loader import load_for_serving

    cfg = EngineConfig(block_size=8, num_kv_blocks=96, max_num_seqs=8, max_num_batched_tokens=64, seed=0,
                       device=device, dtype="float32", **over)
    dev = torch.device(device)
    loaded = load_for_serving(ckpt, dev, torch.float32, tensor_parallel=cfg.tensor_parallel)
    return LLMEngine(loaded, cfg, dev, torch.float32)


@pytest.fixture(scope="module", params=["llama-gqa", "gpt2"])
def engines(request, tmp_path_factory):
    """(eager engine, padded-decode engine) over one tiny checkpoint."""
    over = GPT2 if request.param == "gpt2" else {}
    ckpt = make_checkpoint(tmp_path_factory.mktemp(request.param), tiny_config(**over))
    return build(ckpt), build(ckpt, padded_decode=True, cuda_graph_sizes=SIZES)


def workload(sampled: bool) -> dict[str, tuple[list[int], SamplingParams]]:
    """Five requests (a batch of 5: bucket 8) whose lengths differ, so the batch shrinks to 4, 3
    (bucket 4), 2 and 1 as they finish; two share a 17-token prefix (prefix caching is on)."""
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(3, 500, (17,), generator=g).tolist()
    prompts = [shared + [5], shared + [6, 7], *(torch.randint(3, 500, (n,), generator=g).tolist() for n in (3, 9, 1))]
    return requests_of(prompts, (3, 12, 6, 9, 14), sampled)


def requests_of(prompts: list[list[int]], lengths, sampled: bool) -> dict[str, tuple[list[int], SamplingParams]]:
    """Request r<i>: prompt i, lengths[i] tokens past EOS, greedy or sampled with seed 100 + i; logprobs on."""
    out = {}
    for i, (prompt, n) in enumerate(zip(prompts, lengths)):
        params = (SamplingParams(max_tokens=n, temperature=0.9, top_p=0.95, seed=100 + i, ignore_eos=True, logprobs=0)
                  if sampled else SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=0))
        out[f"r{i}"] = (prompt, params)
    return out


def outputs(engine, requests) -> dict:
    """Each request's tokens; the logprobs of them all, in order, under the key "logprobs" (a
    corrupted key/value shifts them long before it flips a token of this tiny model)."""
    return tokens_and_logprobs(run_all(engine, requests))


def tokens_and_logprobs(runs: dict[str, list]) -> dict:
    """Request id -> its tokens, and "logprobs" -> every output's logprobs in request-id order."""
    out: dict = {rid: token_ids(outs) for rid, outs in runs.items()}
    out["logprobs"] = torch.tensor([lp.logprob for rid in sorted(runs) for o in runs[rid] for lp in o.new_logprobs])
    return out


def assert_same(ours: dict, theirs: dict) -> None:
    lp, ref = ours.pop("logprobs"), theirs.pop("logprobs")
    assert ours == theirs
    # Padding changes only the matmuls' row count (fp32, deterministic on CPU): measured up to 3.7e-6
    # (hybrid models, test_hybrid_padded_decode.py).
    assert lp.shape == ref.shape and (lp - ref).norm() / ref.norm() < 1e-5


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded-sampled"])
def test_padded_decode_buckets_give_the_unpadded_engines_outputs(engines, sampled):
    eager, padded = engines
    before = sum(padded.runner.decode_graphs.replays.values())
    requests = workload(sampled)
    assert_same(outputs(padded, requests), outputs(eager, requests))
    replays = padded.runner.decode_graphs.replays
    assert sum(replays.values()) > before
    assert {8, 4, 2, 1} <= set(replays)  # 5 and 3 sequences padded; 4, 2 and 1 exact buckets
    assert padded.blocks.num_used == 0 and eager.blocks.num_used == 0


def test_second_wave_reads_the_prefix_cache_written_beside_padding_rows(engines):
    # The first wave's full prefix blocks stay cached; padding rows of its decode steps wrote the
    # scratch block only, so a second wave that adopts those blocks still equals the eager engine.
    eager, padded = engines
    first = workload(sampled=False)
    outputs(padded, first)
    outputs(eager, first)
    hits = padded.blocks.prefix_hits
    second = {f"again-{rid}": req for rid, req in first.items()}
    assert_same(outputs(padded, second), outputs(eager, second))
    assert padded.blocks.prefix_hits > hits


def test_speculative_steps_run_eagerly_beside_padded_decode_steps(engines):
    # n-gram drafts make rows of 1 + k tokens (eager); steps without drafts pad. Greedy output is
    # the eager engine's without speculation.
    from tessera.inference.config import SpeculativeConfig

    eager, padded = engines
    spec = build(padded.loaded.path, padded_decode=True, cuda_graph_sizes=SIZES,
                 speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=2, prompt_lookup_min=1,
                                               prompt_lookup_max=2))
    requests = workload(sampled=False)
    assert_same(outputs(spec, requests), outputs(eager, requests))
    assert spec.stats().spec_num_drafts > 0 and sum(spec.runner.decode_graphs.replays.values()) > 0


def test_padded_decode_over_an_fp8_kv_cache_equals_eager_fp8(engines):
    eager, _ = engines
    path = eager.loaded.path
    requests = workload(sampled=False)
    theirs = outputs(build(path, kv_cache_dtype="fp8"), requests)
    padded = build(path, kv_cache_dtype="fp8", padded_decode=True, cuda_graph_sizes=SIZES)
    assert padded.runner.kv.dtype == torch.float8_e4m3fn
    assert_same(outputs(padded, requests), theirs)
    assert {8, 4} <= set(padded.runner.decode_graphs.replays)


def test_the_scratch_block_is_the_pools_last_and_never_handed_out(engines):
    _, padded = engines
    graphs = padded.runner.decode_graphs
    assert graphs.scratch == padded.runner.num_blocks - 1 == padded.blocks.num_blocks
    assert padded.blocks.num_blocks == 95  # 96 in the pool, one reserved


def test_padding_rows_write_only_the_scratch_block_and_logits_equal_unpadded(engines):
    _, padded = engines
    runner, graphs = padded.runner, padded.runner.decode_graphs
    g = torch.Generator().manual_seed(0)
    original = runner.kv.clone()  # the module's engines keep their cached blocks for later tests
    with torch.no_grad():
        runner.kv.copy_(torch.randn(runner.kv.shape, generator=g))
    # Three decoding sequences (bucket 4) over blocks of the pool; lengths 5, 13 and 20 after this token.
    batch = [BatchSeq([11], 4, [7], 1), BatchSeq([12], 12, [3, 9], 1), BatchSeq([13], 19, [20, 21, 22], 1)]
    before = runner.kv.clone()
    with torch.inference_mode():
        padded_logits = runner.forward_batch(batch, [0, 1, 2])
        changed = (runner.kv != before).any(dim=(0, 1, 4, 5))  # [block, slot]
        after = runner.kv.clone()
        runner.kv.copy_(before)
        runner.decode_graphs = None
        try:
            eager_logits = runner.forward_batch(batch, [0, 1, 2])
        finally:
            runner.decode_graphs = graphs
        eager_kv = runner.kv.clone()
        runner.kv.copy_(original)
    written = {(7, 4), (9, 4), (22, 3)}  # each new token's (block, slot)
    assert {tuple(x) for x in changed.nonzero().tolist()} - {(graphs.scratch, 0)} == written
    assert changed[graphs.scratch, 0]  # the padding row's K/V
    pool = slice(0, graphs.scratch)  # the same K/V as the eager step wrote
    assert (after[:, :, pool] - eager_kv[:, :, pool]).norm() / eager_kv[:, :, pool].norm() < 1e-6
    assert ((padded_logits - eager_logits).norm() / eager_logits.norm()) < 1e-5


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" or not triton_available(),
                    reason="needs Triton's interpreter (TRITON_INTERPRET=1, as make test sets)")
def test_padded_decode_through_the_triton_kernel_equals_the_reference(engines, monkeypatch):
    # What a captured graph runs on CUDA: the paged-attention Triton kernel over block tables
    # padded to max_model_len / block_size, with padding rows on the scratch block.
    _, padded = engines
    kernel_matches_reference(padded.runner, [[7], [3, 9], [20, 21, 22]], monkeypatch)
    assert padded.runner.decode_graphs.block_tables.shape[1] == 256 // 8  # max_model_len / block_size


def kernel_matches_reference(runner, tables: list[list[int]], monkeypatch) -> None:
    """Three decode rows (positions 4, 12, 19 over `tables`) through the padded forward twice, over
    the same random pool: the reference attention, then the Triton kernel; outputs equal."""
    batch = [BatchSeq([11], 4, tables[0], 1), BatchSeq([12], 12, tables[1], 1), BatchSeq([13], 19, tables[2], 1)]
    with torch.no_grad():
        runner.kv.copy_(torch.randn(runner.kv.shape, generator=torch.Generator().manual_seed(1)))
    start = runner.kv.clone()
    with torch.inference_mode():
        reference = runner.forward_batch(batch, [0, 1, 2])
        runner.kv.copy_(start)
        monkeypatch.setenv("TESSERA_FORCE_TRITON", "1")
        monkeypatch.delenv("TESSERA_DISABLE_TRITON", raising=False)
        kernel = runner.forward_batch(batch, [0, 1, 2])
    assert ((kernel - reference).norm() / reference.norm()) < 1e-5


def test_prefill_and_over_bucket_steps_run_eagerly(engines):
    _, padded = engines
    graphs = padded.runner.decode_graphs
    assert graphs.bucket([BatchSeq([1, 2], 0, [0], 0)]) is None  # a prefill chunk
    assert graphs.bucket([BatchSeq([1], 3, [0], 1)] * 9) is None  # more than the largest bucket
    assert graphs.bucket([BatchSeq([1], 3, [0], 1)] * 5) == 8


def test_capture_sizes_default_to_vllms_and_end_at_max_num_seqs():
    assert default_capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert default_capture_sizes(5) == [1, 2, 4, 5]
    assert default_capture_sizes(1) == [1]
    assert default_capture_sizes(300)[-5:] == [248, 256, 272, 288, 300]


def test_bucket_is_the_smallest_size_that_holds_the_batch():
    assert [bucket_for(n, [1, 2, 4, 8]) for n in (1, 2, 3, 4, 5, 8, 9)] == [1, 2, 4, 4, 8, 8, None]


def test_capture_sizes_parse_spaces_and_commas():
    assert parse_capture_sizes(["8", "1,2", "4 2"]) == [1, 2, 4, 8]
    for bad in (["0"], ["-1"], ["two"], ["2.5"], ["1,,x"], ["\u00b2"], [" "]):
        with pytest.raises(UserError, match="--cuda-graph-sizes"):
            parse_capture_sizes(bad)


@pytest.mark.parametrize("flags, expected", [
    (["--cuda-graph-sizes", "0"], "'0' is not a positive integer"),
    (["--cuda-graph-sizes", "1", "x"], "'x' is not a positive integer"),
    (["--cuda-graph-sizes", "1", "128", "--max-num-seqs", "64"], "128 is above max-num-seqs (64)"),
    (["--cuda-graph-sizes", "1", "--enforce-eager"], "contradicts enforce-eager"),
    (["--cuda-graph-sizes", "1", "2", "--device", "cpu"], "CUDA graphs need a CUDA device"),
])
def test_bad_graph_flags_are_refused_in_one_line(tmp_path, capsys, flags, expected):
    from tessera.inference.entrypoints.serve_cli import main

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()  # refused before anything reads it
    with pytest.raises(SystemExit) as exc:
        run_cli(main, ["--checkpoint", str(ckpt), *flags])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expected in err[0] and "Traceback" not in err[0], err


def test_tensor_parallel_captures_only_when_sizes_are_given():
    from tessera.inference.worker.cuda_graphs import decode_graph_mode

    cuda = torch.device("cuda")
    assert decode_graph_mode(EngineConfig(tensor_parallel=2), cuda) == "off"
    assert decode_graph_mode(EngineConfig(tensor_parallel=2, cuda_graph_sizes=[1, 2]), cuda) == "capture"
    assert decode_graph_mode(EngineConfig(), cuda) == "capture"
    assert decode_graph_mode(EngineConfig(enforce_eager=True), cuda) == "off"
    assert decode_graph_mode(EngineConfig(), torch.device("cpu")) == "off"


@pytest.mark.slow
@pytest.mark.distributed
def test_tp2_workers_pad_decode_steps_like_one_eager_process(tmp_path):
    # Each gloo worker runs the padded forward over its shard (its scratch block the same id in
    # every rank's pool); the driver gathers the logits rows as before.
    ckpt = make_checkpoint(tmp_path, tiny_config(num_heads=8, num_kv_heads=4))
    requests = workload(sampled=True)
    theirs = outputs(build(ckpt), requests)
    tp2 = build(ckpt, tensor_parallel=2, padded_decode=True, cuda_graph_sizes=SIZES)
    try:
        assert tp2.blocks.num_blocks == 95
        assert_same(outputs(tp2, requests), theirs)
    finally:
        tp2.close()


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["llama-gqa", "gpt2"])
def test_captured_graphs_replay_the_eager_engines_outputs(tmp_path, arch):
    ckpt = make_checkpoint(tmp_path, tiny_config(**(GPT2 if arch == "gpt2" else {})))
    eager = build(ckpt, "cuda", enforce_eager=True)
    graphed = build(ckpt, "cuda", cuda_graph_sizes=SIZES)
    graphs = graphed.runner.decode_graphs
    assert graphs.capture and sorted(graphs.graphs) == SIZES
    for sampled in (False, True):
        requests = workload(sampled)
        assert_same(outputs(graphed, requests), outputs(eager, requests))
    assert {8, 4, 2, 1} <= set(graphs.replays)


@pytest.mark.gpu
def test_graphs_are_on_by_default_on_cuda_and_off_with_enforce_eager(tmp_path):
    ckpt = make_checkpoint(tmp_path, tiny_config())
    assert build(ckpt, "cuda").runner.decode_graphs.sizes == [1, 2, 4, 8]
    assert build(ckpt, "cuda", enforce_eager=True).runner.decode_graphs is None
    assert build(ckpt, "cpu").runner.decode_graphs is None
