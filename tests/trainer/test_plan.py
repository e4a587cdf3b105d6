"""tessera-plan: the accounting its predictions rest on, and the CLI (in process; no launch).

The predictions themselves are checked against measured peaks in test_plan_validation.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tessera.common.errors import run_cli
from tessera.common.layout import ParallelLayout
from tessera.common.models.causal_lm.config import ModelConfig, preset
from tessera.trainer.plan.cli import main
from tessera.trainer.plan.devices import DEVICES
from tessera.trainer.plan.memory import plan_memory, rank_params
from tessera.trainer.plan.spec import PlanSpec
from tessera.trainer.plan.timing import plan_time

MODEL = dict(arch="llama", vocab_size=2048, hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
             ffn_hidden_size=352, max_seq_len=64)


def spec(layout: dict | None = None, model: ModelConfig | None = None, **kw) -> PlanSpec:
    return PlanSpec(model=model or ModelConfig(**MODEL), layout=ParallelLayout(**(layout or {})),
                    **{**dict(seq_len=64, global_batch=8, micro_batch=2), **kw})


def test_parameters_per_rank_add_up_to_the_models_count():
    cfg = ModelConfig(**MODEL)
    assert rank_params(spec()).total == cfg.num_params()
    pp = spec(dict(pipeline=2))
    assert sum(rank_params(pp, r).total for r in range(2)) == cfg.num_params()
    # Tensor parallel: everything but the replicated norms is split in two.
    norms = cfg.hidden_size * (2 * cfg.num_layers + 1)
    assert rank_params(spec(dict(tensor=2))).total * 2 - norms == cfg.num_params()


def test_a_tied_embedding_is_held_twice_across_pipeline_stages():
    cfg = ModelConfig(**{**MODEL, "tie_embeddings": True})
    both = sum(rank_params(spec(dict(pipeline=2), cfg), r).total for r in range(2))
    assert both == cfg.num_params() + cfg.vocab_rows * cfg.hidden_size


def test_expert_parallel_divides_only_the_routed_experts():
    cfg = preset("mixtral-tiny")
    one, two = rank_params(spec(model=cfg)).total, rank_params(spec(dict(expert=2), cfg)).total
    experts = cfg.num_layers * 3 * cfg.moe.num_experts * cfg.moe.ffn_hidden_size * cfg.hidden_size
    assert one - two == experts // 2


def test_fsdp_with_expert_parallel_shards_dense_parameters_over_data_and_expert_ranks():
    cfg = preset("mixtral-tiny")
    one = rank_params(spec(model=cfg))
    mem = plan_memory(spec(dict(data=2, data_shard=2, expert=2), cfg))
    ep2 = rank_params(spec(dict(expert=2), cfg))
    assert ep2.experts * 2 == one.experts > 0
    assert mem.weights == pytest.approx(4.0 * ((ep2.total - ep2.experts) / 4 + ep2.experts / 2))


def test_expert_ranks_read_their_own_batch_rows_and_hold_zero1_shards_of_the_dense_state():
    """As the runtime: EP2 at data 1 runs global/(micro x 2) micro-batches, its distributed
    optimizer shards the dense moments over the two expert ranks (experts' over data ranks only),
    and their dense gradients travel between them."""
    cfg = preset("mixtral-tiny")
    ep2 = spec(dict(expert=2), cfg)
    assert ep2.num_microbatches == 2  # 8 rows / (micro-batch 2 x 2 expert ranks)
    params = rank_params(ep2)
    moments = 8.0 * ((params.total - params.experts) / 2 + params.experts)
    assert plan_memory(ep2).optimizer == pytest.approx(moments)
    assert "data (reduce-scatter)" in plan_time(ep2, DEVICES["h100"]).comm


def test_fsdp_shards_weights_grads_and_optimizer_state_by_the_shard_count():
    full, sharded = plan_memory(spec()), plan_memory(spec(dict(data=4, data_shard=4)))
    assert sharded.static * 4 == pytest.approx(full.static)
    zero1 = plan_memory(spec(dict(data=4)))  # ZeRO-1: only the Adam moments are sharded
    assert zero1.weights == full.weights and zero1.optimizer * 4 == pytest.approx(full.optimizer)


def test_fsdp_with_context_parallel_shards_the_state_over_data_and_context_ranks():
    """As the runtime (dp_shard_cp): FSDP 2 x CP 2 holds a quarter of the weights, gradients and
    Adam state, as FSDP 4 does, not the half its two data shards alone would give."""
    full, cp_fsdp = plan_memory(spec()), plan_memory(spec(dict(data=2, data_shard=2, context=2)))
    assert cp_fsdp.static * 4 == pytest.approx(full.static)
    assert cp_fsdp.static == pytest.approx(plan_memory(spec(dict(data=4, data_shard=4))).static)


def test_bf16_with_fp32_masters_holds_two_byte_weights_and_eighteen_bytes_in_all():
    m = plan_memory(spec(precision="bf16-master"))
    n = rank_params(spec()).total
    assert m.weights == 2 * n and m.static == 18 * n


def test_recompute_and_sequence_parallel_lower_the_activations():
    none, sel, full = (plan_memory(spec(recompute=r)).activations for r in ("none", "selective", "full"))
    assert full < sel <= none
    sp = plan_memory(spec(dict(tensor=2), sequence_parallel=True)).activations
    no_sp = plan_memory(spec(dict(tensor=2), sequence_parallel=False)).activations
    assert sp < no_sp


def test_one_rank_without_communication_reaches_exactly_the_assumed_efficiency():
    t = plan_time(spec(), DEVICES["h100"], efficiency=0.4)
    assert t.exposed_comm_s == 0 and t.bubble_s == 0
    assert t.mfu(1, DEVICES["h100"].peak_tflops) == pytest.approx(0.4)
    piped = plan_time(spec(dict(pipeline=2)), DEVICES["h100"], efficiency=0.4)
    assert piped.bubble_s > 0 and piped.mfu(2, DEVICES["h100"].peak_tflops) < 0.4


def _config(tmp_path, **training) -> str:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(dict(model=MODEL, training=dict(seq_length=64, micro_batch_size=2,
                                                                   global_batch_size=8, **training))))
    return str(path)


def test_cli_plans_one_layout_and_the_json_matches_the_library(tmp_path, capsys):
    assert main(["--config", _config(tmp_path), "--tensor-parallel", "2", "--data-parallel", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    expected = plan_memory(spec(dict(tensor=2, data=2)))
    assert out["layout"] == "tp2-cp1-ep1-dp2-pp1"
    assert out["memory_gib"]["peak"] == pytest.approx(expected.peak / 2**30)
    assert out["fits"] is True


def test_cli_ranks_every_valid_layout_of_a_gpu_count(tmp_path, capsys):
    assert main(["--config", _config(tmp_path), "--gpus", "4", "--json", "--top", "100"]) == 0
    rows = json.loads(capsys.readouterr().out)
    layouts = {r["layout"] for r in rows}
    assert "tp1-cp1-ep1-dp4s4-pp1" in layouts and "tp2-cp1-ep1-dp1-pp2" in layouts
    fitting = [r["step_s"] for r in rows if r["fits"]]
    assert fitting == sorted(fitting)


def test_the_search_with_fp8_all_gather_proposes_only_fsdp_over_one_tensor_rank(tmp_path, capsys):
    assert main(["--config", _config(tmp_path), "--gpus", "4", "--precision", "fp8-master", "--fp8-all-gather",
                 "--json", "--top", "100"]) == 0
    layouts = {r["layout"] for r in json.loads(capsys.readouterr().out)}
    assert "tp1-cp1-ep1-dp4s4-pp1" in layouts
    assert all(lay.startswith("tp1-") and "s" in lay.split("-dp")[1].split("-")[0] for lay in layouts), layouts


def test_cli_reads_precision_and_recompute_from_the_config(tmp_path, capsys):
    main(["--config", _config(tmp_path, recompute="full"), "--json"])
    assert json.loads(capsys.readouterr().out)["recompute"] == "full"


@pytest.mark.parametrize("flags, words", [
    (["--tensor-parallel", "3"], "--tensor-parallel 3 must divide num_heads"),
    (["--device", "custom", "--memory-gib", "80"], "--device custom needs --peak-tflops"),
    (["--context-parallel", "3"], "seq_len (64) must be divisible by 2 x 3"),
    (["--fp8-all-gather", "--precision", "fp8"], "--fp8-all-gather needs --precision fp8-master"),
    (["--fp8-all-gather", "--precision", "fp8-master", "--tensor-parallel", "2", "--data-parallel", "2",
      "--data-shard", "2"], "--fp8-all-gather does not compose with --tensor-parallel 2"),
])
def test_bad_layouts_and_devices_are_refused_with_one_line(tmp_path, flags, words):
    proc = subprocess.run([sys.executable, "-m", "tessera.trainer.plan.cli", "--config", _config(tmp_path), *flags],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    lines = [ln for ln in proc.stderr.splitlines() if "Warning" not in ln and "_conversion_method" not in ln]
    assert len(lines) == 1 and words in lines[0], proc.stderr


def test_a_bad_override_is_reported_against_the_override_not_the_config_file(tmp_path, capsys):
    config = _config(tmp_path)
    with pytest.raises(SystemExit) as exc:
        run_cli(main, ["--config", config, "training.seq_length=abc"])
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and len(err.splitlines()) == 1, err
    assert "override training.seq_length=abc: invalid config: training.seq_length" in err and config not in err, err


def test_context_parallel_with_data_shard_is_a_valid_layout_and_the_train_docs_say_so(tmp_path, capsys):
    """Issue 28.8: docs/cli/tessera-train.md said context (and expert) parallel do not combine with
    data_shard > 1; they do (tests/parallel/test_fsdp.py runs CP 2 x FSDP 2 against one process,
    test_ep_fsdp.py EP 2 x FSDP 2)."""
    assert main(["--config", _config(tmp_path), "--context-parallel", "2", "--data-parallel", "2",
                 "--data-shard", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["layout"] == "tp1-cp2-ep1-dp2s2-pp1"
    doc = (Path(__file__).parents[2] / "docs" / "cli" / "tessera-train.md").read_text()
    row = next(line for line in doc.splitlines() if line.startswith("| context |"))
    assert "composes with data_shard > 1" in row
    assert "not with data_shard" not in doc and "or with `data_shard > 1`" not in doc


def test_a_mixture_of_experts_model_is_planned_though_its_routing_cannot_run_on_fake_tensors():
    cfg = preset("mixtral-tiny")
    moe = plan_memory(spec(model=cfg)).activations
    dense = plan_memory(spec(model=cfg.model_copy(update={"moe": None}))).activations
    assert moe > dense  # top_k experts' widths, dispatched copies and router outputs per token


def test_the_fp8_block_measurement_on_fake_tensors_is_what_a_real_float8_block_keeps():
    """The planner measures what torchao's Float8Linear saves for backward on a fake block; the
    same block run for real on CPU (torchao's float8 casts emulated) keeps exactly those bytes."""
    pytest.importorskip("torchao")
    import gc

    import torch
    from torch.multiprocessing.reductions import StorageWeakRef

    from tessera.common.layers.rope import RotaryEmbedding
    from tessera.common.models.causal_lm.model import Block
    from tessera.trainer.plan.activations import _LiveStorages, float8_as_on_cuda, measure_block

    cfg = ModelConfig(**{**MODEL, "num_layers": 1})
    predicted = measure_block(cfg.model_dump_json(), 0, 2, 64, "fp8", "none")
    block = Block(cfg, 0)
    float8_as_on_cuda(block)
    rope = RotaryEmbedding(cfg)(torch.arange(64).unsqueeze(0))
    x = torch.randn(2, 64, cfg.hidden_size, requires_grad=True)
    keep = {StorageWeakRef(p.untyped_storage()).cdata for p in block.parameters()}
    tracker = _LiveStorages(set(keep))
    with tracker, torch.autocast("cpu", dtype=torch.bfloat16):
        y = block(x, rope)
    gc.collect()
    keep |= {StorageWeakRef(t.untyped_storage()).cdata for t in (y, *rope)} | tracker.weight_copies
    assert tracker.live_bytes(keep) + x.untyped_storage().nbytes() == predicted


def test_an_fp8_plan_holds_no_autocast_copies_of_the_blocks_weights():
    """The trainer's fp8 keeps fp32 weights (as bf16), but its Float8Linear layers cast them to
    float8 in forward and again in backward: only the unconverted head keeps a bf16 copy."""
    pytest.importorskip("torchao")
    bf16, fp8 = plan_memory(spec(precision="bf16")), plan_memory(spec(precision="fp8"))
    params = rank_params(spec())
    head = MODEL["vocab_size"] * MODEL["hidden_size"]
    assert fp8.static == bf16.static
    assert bf16.buffers - fp8.buffers == pytest.approx(2 * (params.total - head))
    assert fp8.activations <= bf16.activations
    master = plan_memory(spec(precision="fp8-master"))
    assert master.static == plan_memory(spec(precision="bf16-master")).static == 18 * params.total


def test_fsdp_under_pipeline_parallel_holds_each_stages_unsharded_fp32_gradients():
    """The pipeline schedule syncs FSDP's gradients on a stage's last micro-batch only: until then
    every block's unsharded gradient accumulates in fp32 (validated by the measured fsdp2 x pp2
    layout); without pipeline parallel only the sharded gradients exist."""
    fsdp_pp = spec(dict(data=2, data_shard=2, pipeline=2), precision="bf16-master")
    mem = plan_memory(fsdp_pp, pp_rank=0)
    n = rank_params(fsdp_pp, 0).total
    assert not mem.grads_in_backward  # the sharded ones appear only as the unsharded are reduce-scattered
    gathered = 2 * n  # every block stays gathered in bf16 under pipeline parallel
    assert mem.buffers >= 4 * n + gathered
    no_pp = plan_memory(fsdp_pp.model_copy(update={"layout": ParallelLayout(data=2, data_shard=2)}))
    assert no_pp.buffers < 4 * rank_params(fsdp_pp.model_copy(update={"layout": ParallelLayout()})).total


def test_packed_documents_keep_no_mask_and_their_segments_are_planned_on_cpu():
    """Context parallel with one document per sample holds a [T/C, T] mask; packed documents do
    not (per-segment SDPA on CPU: padded query segments instead; FlexAttention's block mask on CUDA
    is (T/C/128) x (T/128) entries)."""
    cp = dict(context=2)
    one_doc = plan_memory(spec(cp, device_type="cpu"))
    cpu = plan_memory(spec(cp, packed_documents=True, device_type="cpu"))
    cuda = plan_memory(spec(cp, packed_documents=True, device_type="cuda"))
    mask = 32 * 64 * 4.0  # [T/C, T] fp32, once per micro-batch
    block_mask = 4 * 2 * 1 * 4.0  # four int32 [rows=2, 1, 1] block tensors (32 and 64 tokens: one block each)
    assert one_doc.activations - cuda.activations == pytest.approx(mask - block_mask)
    assert cpu.activations > cuda.activations
