"""The compiled CPU forward (compiled.py) serves the eager engine's tokens, and every served model
(the engine's, each tensor-parallel worker's shard, the speculative draft) is prepared in one place
(prepare.py): q/k/v and gate/up stacked, Linear weights oneDNN-packed or the stack compiled.

The suite serves eagerly (tests/conftest.py sets TESSERA_CPU_COMPILE=0); only the first three tests
compile (tiny models, one graph each)."""

from __future__ import annotations

import pytest
import torch
from inference_helpers import make_checkpoint, make_engine, run_all, tiny_config, token_ids
from test_cuda_graphs import GPT2, SIZES, assert_same, build, outputs, workload
from torch._inductor.exc import InvalidCxxCompiler

from tessera.common.errors import UserError
from tessera.inference.config import EngineConfig, SpeculativeConfig
from tessera.inference.core.sampling_params import SamplingParams
from tessera.inference.worker.compiled import CompiledForward
from tessera.inference.worker.cpu_linear import PackedLinear


def packed(model: torch.nn.Module) -> int:
    return sum(isinstance(m, PackedLinear) for m in model.modules())


@pytest.mark.parametrize("family", ["llama-gqa", "gpt2"])
def test_a_compiled_cpu_engine_gives_the_eager_engines_greedy_tokens_and_logprobs(tmp_path, family):
    ckpt = make_checkpoint(tmp_path, tiny_config(**(GPT2 if family == "gpt2" else {})))
    eager, compiled = build(ckpt, cpu_compile=False), build(ckpt, cpu_compile=True)
    assert eager.runner.compiled is None and packed(eager.runner.model) == 4 * 2  # qkv, o, gate_up/up, down
    assert isinstance(compiled.runner.compiled, CompiledForward) and packed(compiled.runner.model) == 0
    # Batches of 5 shrinking to 1, chunked prefills, a shared prefix: all through the one graph.
    requests = workload(sampled=False)
    assert_same(outputs(compiled, requests), outputs(eager, requests))
    assert compiled.blocks.num_used == 0
    assert compiled.runner.compiled.graphs() == 1


def test_two_models_of_one_shape_each_compile_one_graph_of_their_own_packed_weights(tmp_path):
    # Each CompiledForward has its own code object, so its graph (and the frozen, packed weights it
    # holds) is its own: a second model of the same shape neither reuses the first's graph nor
    # counts against its recompile limit.
    from torch._dynamo.utils import counters

    cfg = tiny_config(num_layers=1)
    a, b = make_checkpoint(tmp_path / "a", cfg, seed=1), make_checkpoint(tmp_path / "b", cfg, seed=2)
    counters.clear()
    # No graph caches: inductor's passes run (and count the weights they pack) for each model.
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        first = build(a, cpu_compile=True)
        assert counters["inductor"]["mkldnn_linear_weight_pack_matcher_count"] == 4  # qkv, o, gate_up, down
        second = build(b, cpu_compile=True)
        assert counters["inductor"]["mkldnn_linear_weight_pack_matcher_count"] == 8
    assert first.runner.compiled.code is not second.runner.compiled.code
    requests = workload(sampled=False)
    assert_same(outputs(first, requests), outputs(build(a, cpu_compile=False), requests))
    assert_same(outputs(second, requests), outputs(build(b, cpu_compile=False), requests))
    assert first.runner.compiled.graphs() == second.runner.compiled.graphs() == 1


def test_padded_decode_steps_run_the_compiled_stack_and_keep_the_eager_outputs(tmp_path):
    ckpt = make_checkpoint(tmp_path, tiny_config(num_layers=1), seed=3)
    padded = build(ckpt, cpu_compile=True, padded_decode=True, cuda_graph_sizes=SIZES)
    requests = workload(sampled=False)
    assert_same(outputs(padded, requests), outputs(build(ckpt, cpu_compile=False), requests))
    assert sum(padded.runner.decode_graphs.replays.values()) > 0 and packed(padded.runner.model) == 0
    assert padded.runner.compiled.graphs() == 1  # the padded rows went through the warm-up's graph


def test_enforce_eager_and_the_test_environment_turn_compile_off(monkeypatch):
    monkeypatch.setenv("TESSERA_CPU_COMPILE", "0")  # as tests/conftest.py sets it
    assert not EngineConfig().compile_on_cpu
    assert EngineConfig(cpu_compile=True).compile_on_cpu
    monkeypatch.delenv("TESSERA_CPU_COMPILE")
    assert EngineConfig().compile_on_cpu and not EngineConfig(enforce_eager=True).compile_on_cpu
    with pytest.raises(ValueError, match="contradicts enforce_eager"):
        EngineConfig(cpu_compile=True, enforce_eager=True)
    with pytest.raises(ValueError, match="served eagerly"):
        EngineConfig(cpu_compile=True, tensor_parallel=2)
    assert not EngineConfig(cpu_linear="aten").compile_on_cpu  # plain F.linear: compiling would pack
    with pytest.raises(ValueError, match="cpu_linear aten is served eagerly"):
        EngineConfig(cpu_compile=True, cpu_linear="aten")
    monkeypatch.setenv("TESSERA_CPU_COMPILE", "yes")
    with pytest.raises(ValueError, match="TESSERA_CPU_COMPILE='yes': use 0"):
        EngineConfig()


def no_cxx_compiler(self, runner, rows):
    raise InvalidCxxCompiler()


def test_a_failed_default_compile_is_a_warning_and_the_engine_serves_eagerly_with_packed_weights(
        tiny_ckpt, monkeypatch, caplog):
    monkeypatch.setattr(CompiledForward, "warm_up", no_cxx_compiler)
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    want = token_ids(run_all(make_engine(tiny_ckpt, num_kv_blocks=32), {"a": ([4, 9, 200], greedy)})["a"])
    monkeypatch.setenv("TESSERA_CPU_COMPILE", "1")  # the default, not asked for
    engine = make_engine(tiny_ckpt, num_kv_blocks=32)
    assert engine.runner.compiled is None and packed(engine.runner.model) == 4 * 2
    assert "compiling the layer stack failed (InvalidCxxCompiler" in caplog.text
    assert token_ids(run_all(engine, {"a": ([4, 9, 200], greedy)})["a"]) == want


def test_an_explicit_cpu_compile_that_fails_or_cannot_compile_is_refused(tiny_ckpt, tmp_path, monkeypatch):
    monkeypatch.setattr(CompiledForward, "warm_up", no_cxx_compiler)
    with pytest.raises(UserError, match="cpu_compile: compiling model's layer stack failed .*drop cpu_compile"):
        make_engine(tiny_ckpt, num_kv_blocks=32, cpu_compile=True)
    moe = make_checkpoint(tmp_path, tiny_config(arch="mixtral", moe=dict(num_experts=4, top_k=2, ffn_hidden_size=64)))
    with pytest.raises(UserError, match="cpu_compile: model cannot be compiled .*mixture-of-experts"):
        make_engine(moe, num_kv_blocks=32, cpu_compile=True)


def test_a_bug_while_compiling_is_not_reported_as_a_failed_compile(tiny_ckpt, monkeypatch):
    def bug(self, runner, rows):
        raise IndexError("a bug in the runner")

    monkeypatch.setattr(CompiledForward, "warm_up", bug)
    monkeypatch.setenv("TESSERA_CPU_COMPILE", "1")
    with pytest.raises(IndexError, match="a bug in the runner"):
        make_engine(tiny_ckpt, num_kv_blocks=32)


def test_the_draft_model_is_prepared_like_the_target_and_speculation_keeps_the_tokens(tiny_ckpt, tmp_path):
    draft = make_checkpoint(tmp_path, tiny_config(num_layers=1), seed=5)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    requests = {"a": ([4, 9, 200, 31, 77, 5], greedy), "b": ([17, 300, 2, 2, 45], greedy)}
    plain = make_engine(tiny_ckpt, block_size=8, num_kv_blocks=64)
    spec = make_engine(tiny_ckpt, block_size=8, num_kv_blocks=64,
                       speculative=SpeculativeConfig(model=str(draft), num_speculative_tokens=3))
    assert packed(spec.proposer.runner.model) == 4  # one layer: qkv, o, gate_up, down
    want = {rid: token_ids(o) for rid, o in run_all(plain, requests).items()}
    assert {rid: token_ids(o) for rid, o in run_all(spec, requests).items()} == want
    assert spec.stats().spec_num_drafts > 0
