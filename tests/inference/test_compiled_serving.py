"""The compiled CPU forward (compiled.py) serves the eager engine's tokens, and every served model
(the engine's, each tensor-parallel worker's shard, the speculative draft) is prepared in one place
(prepare.py): q/k/v and gate/up stacked, Linear weights oneDNN-packed or the stack compiled.

The suite serves eagerly (tests/conftest.py sets TESSERA_CPU_COMPILE=0); only the first test
compiles (two tiny models, two graphs each)."""

from __future__ import annotations

import pytest
import torch
from inference_helpers import make_checkpoint, make_engine, run_all, tiny_config, token_ids
from test_cuda_graphs import GPT2, assert_same, build, outputs, workload

from tessera.inference.compiled import CompiledForward
from tessera.inference.config import EngineConfig, SpeculativeConfig
from tessera.inference.cpu_linear import PackedLinear
from tessera.inference.sampling_params import SamplingParams


def packed(model: torch.nn.Module) -> int:
    return sum(isinstance(m, PackedLinear) for m in model.modules())


@pytest.mark.parametrize("family", ["llama-gqa", "gpt2"])
def test_a_compiled_cpu_engine_gives_the_eager_engines_greedy_tokens_and_logprobs(tmp_path, family):
    ckpt = make_checkpoint(tmp_path, tiny_config(**(GPT2 if family == "gpt2" else {})))
    eager, compiled = build(ckpt, cpu_compile=False), build(ckpt, cpu_compile=True)
    assert eager.runner.compiled is None and packed(eager.runner.model) == 4 * 2  # qkv, o, gate_up/up, down
    assert isinstance(compiled.runner.compiled, CompiledForward) and packed(compiled.runner.model) == 0
    # Batches of 5 shrinking to 1 (the size-1 graph), chunked prefills, a shared prefix.
    requests = workload(sampled=False)
    assert_same(outputs(compiled, requests), outputs(eager, requests))
    assert compiled.blocks.num_used == 0


def test_enforce_eager_and_the_test_environment_turn_compile_off(monkeypatch):
    assert not EngineConfig().compile_on_cpu  # tests/conftest.py: TESSERA_CPU_COMPILE=0
    assert EngineConfig(cpu_compile=True).compile_on_cpu
    monkeypatch.delenv("TESSERA_CPU_COMPILE")
    assert EngineConfig().compile_on_cpu and not EngineConfig(enforce_eager=True).compile_on_cpu
    with pytest.raises(ValueError, match="contradicts enforce_eager"):
        EngineConfig(cpu_compile=True, enforce_eager=True)
    with pytest.raises(ValueError, match="served eagerly"):
        EngineConfig(cpu_compile=True, tensor_parallel=2)
    monkeypatch.setenv("TESSERA_CPU_COMPILE", "yes")
    with pytest.raises(ValueError, match="TESSERA_CPU_COMPILE='yes': use 0"):
        EngineConfig()


def test_a_failed_compile_is_a_warning_and_the_engine_serves_eagerly_with_packed_weights(tiny_ckpt, monkeypatch,
                                                                                        caplog):
    def fail(self, runner, rows):
        raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found")

    monkeypatch.setattr(CompiledForward, "warm_up", fail)
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    want = token_ids(run_all(make_engine(tiny_ckpt, num_kv_blocks=32), {"a": ([4, 9, 200], greedy)})["a"])
    engine = make_engine(tiny_ckpt, num_kv_blocks=32, cpu_compile=True)
    assert engine.runner.compiled is None and packed(engine.runner.model) == 4 * 2
    assert "compiling the layer stack failed (RuntimeError: InvalidCxxCompiler" in caplog.text
    assert token_ids(run_all(engine, {"a": ([4, 9, 200], greedy)})["a"]) == want


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
