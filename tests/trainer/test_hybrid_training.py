"""Training a hybrid model (Mamba-2, attention, MLP and MoE layers in Megatron's pattern) with
`tessera-train` on one process: the loss falls, packed documents keep to themselves, a resumed run
is bit-identical to an uninterrupted one, and what the kind cannot do is refused in one line."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from conftest import base_config, write_config
from test_bad_input import run_expect_usage_error
from test_checkpoint import final_weights, losses

from tessera.common.checkpoint import read_pointer, read_sidecar, resolve_checkpoint
from tessera.common.models.hybrid.config import HybridConfig
from tessera.common.models.hybrid.model import HybridModel
from tessera.common.models.registry import KINDS
from tessera.trainer.cli import main

# All four layer types, every one small: d=32, 4 SSM heads in 2 groups, 2 MoE experts of 4.
HYBRID = {"kind": "hybrid", "hidden_size": 32, "num_layers": 4, "pattern": "M*-E", "max_seq_len": 64,
          "mamba": {"num_heads": 4, "head_dim": 8, "state_size": 8, "num_groups": 2, "chunk_size": 8},
          "num_heads": 4, "num_kv_heads": 2, "ffn_hidden_size": 64,
          "moe": {"num_experts": 4, "top_k": 2, "ffn_hidden_size": 16, "aux_loss_coef": 0.01}}


def hybrid_config(artifacts, tmp_path: Path, name: str, model: dict | None = None, **sections) -> Path:
    cfg = copy.deepcopy(base_config(artifacts, tmp_path / name))
    cfg["model"] = copy.deepcopy(model or HYBRID)
    for key, value in sections.items():
        cfg[key].update(value)
    return write_config(tmp_path / f"{name}.yaml", cfg)


def test_the_hybrid_kinds_tensor_map_is_its_model_state_dict_without_building_it():
    """What every checkpoint reader checks the DCP index against: names, order and shapes."""
    for over in [{}, {"pattern": "MM*M", "tie_embeddings": True},
                 {"pattern": "EM-M", "mlp_bias": True, "mamba": {**HYBRID["mamba"], "bias": True, "conv_bias": False}}]:
        cfg = HybridConfig.model_validate({**HYBRID, "vocab_size": 96, **over})
        with torch.device("meta"):
            model = HybridModel(cfg)
        assert list(KINDS["hybrid"].tensor_shapes(cfg).items()) == \
            [(k, tuple(v.shape)) for k, v in model.state_dict().items()], over


def test_a_hybrid_model_with_all_four_layer_types_trains_through_tessera_train(artifacts, tmp_path):
    """Packed documents on (reset_attention_mask: attention within each, the Mamba state restarted at
    each): the loss falls, the MoE router is logged, and the checkpoint is of the hybrid kind."""
    config = hybrid_config(artifacts, tmp_path, "run", training={"steps": 10},
                           data={"reset_attention_mask": True, "eod_mask_loss": True}, optim={"lr": 1e-2})
    assert main(["--config", str(config), "--quiet"]) == 0
    loss = losses(tmp_path / "run")
    assert len(loss) == 10 and loss[10] < loss[1] - 0.5, loss
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["moe_aux_loss"] > 0 for r in records if r["kind"] == "train")
    sidecar = read_sidecar(resolve_checkpoint(tmp_path / "run" / "checkpoints"))
    assert sidecar.model.kind == "hybrid" and sidecar.model.pattern == "M*-E"
    # The TFLOP/s and MFU logged are the hybrid count's (Mamba scan and conv included).
    flops = sidecar.model.flops_per_token(32)
    assert all(r["tflops"] == pytest.approx(r["tokens_per_s"] * flops / 1e12, rel=1e-6)
               for r in records if r["kind"] == "train")


def test_a_resumed_hybrid_run_is_bit_identical_to_an_uninterrupted_one(artifacts, tmp_path):
    sections = dict(training={"steps": 4}, data={"reset_attention_mask": True})
    straight = hybrid_config(artifacts, tmp_path, "straight", **sections)
    assert main(["--config", str(straight), "--quiet"]) == 0
    split = hybrid_config(artifacts, tmp_path, "split", **sections)
    assert main(["--config", str(split), "--quiet", "training.exit_after_steps=2"]) == 0
    assert read_pointer(tmp_path / "split" / "checkpoints") == 2
    assert main(["--config", str(split), "--quiet", "--resume"]) == 0
    a, b = final_weights(tmp_path / "straight"), final_weights(tmp_path / "split")
    assert a.keys() == b.keys() and "layers.0.mixer.A_log" in a
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert losses(tmp_path / "straight") == losses(tmp_path / "split")


@pytest.mark.parametrize("overrides, expected", [
    (["data.reset_position_ids=true"], "data.reset_position_ids: a hybrid model has no positions"),
    (["model.pattern=M*-X"], "pattern: 'X' (layer 3) is not a layer symbol"),
    (["model.pattern=M*-"], "pattern: 3 symbols for num_layers=4"),
    (["model.mamba.num_groups=3"], "mamba: num_groups (3) must divide num_heads (4)"),
    (["model.num_kv_heads=3"], "num_kv_heads (3) must divide num_heads (4)"),
    (["model.hidden_size=1000000000"], "hidden_size"),
    (["model.mamba.state_size=100000000"], "mamba.state_size"),
])
def test_what_the_hybrid_kind_cannot_build_is_refused_in_one_line_naming_the_field(artifacts, tmp_path, capsys,
                                                                                 overrides, expected):
    config = hybrid_config(artifacts, tmp_path, "run")
    err = run_expect_usage_error(["--config", str(config), *overrides], capsys)
    assert expected in err, err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("name, hf_class, billions", [("nemotron-h-8b", "NemotronHForCausalLM", 8.10),
                                                       ("mamba2-2.7b", "Mamba2ForCausalLM", 2.70),
                                                       ("hybrid-tiny", "NemotronHForCausalLM", 0.0)])
def test_the_published_shape_presets_are_the_transformers_models_of_those_names(name, hf_class, billions, tmp_path):
    """The preset's config.json (the HF adapter's) builds, in transformers on the meta device, a
    model of exactly the preset's parameter count: Nemotron-H-8B's 8.1B, mamba2-2.7b's 2.7B; the
    tiny one exports as Nemotron-H too."""
    import transformers

    from tessera.common.models.hybrid.config import preset
    from tessera.common.models.registry import hf_adapter

    cfg = preset(name)
    data = hf_adapter(cfg).hf_config(cfg, torch.bfloat16, None, None)
    assert data["architectures"] == [hf_class]
    (tmp_path / "config.json").write_text(json.dumps(data))
    hf_cfg = transformers.AutoConfig.from_pretrained(tmp_path)
    with torch.device("meta"):
        model = getattr(transformers, hf_class)(hf_cfg)
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params()
    assert round(cfg.num_params() / 1e9, 2) == billions


def test_the_example_hybrid_config_trains(artifacts, tmp_path):
    """examples/configs/hybrid-tiny.yaml as a user runs it, on the test mixture for two steps."""
    example = Path(__file__).parents[2] / "examples" / "configs" / "hybrid-tiny.yaml"
    assert main(["--config", str(example), "--quiet", f"data.mixture={artifacts['mixture']}",
                 f"data.tokenizer={artifacts['tokenizer']}", f"run_dir={tmp_path / 'run'}", "training.steps=2",
                 "training.global_batch_size=2", "training.micro_batch_size=2", "training.seq_length=32",
                 "training.eval_interval=0", "training.log_interval=1", "logging.tensorboard=false"]) == 0
    assert set(losses(tmp_path / "run")) == {1, 2}


def test_the_trainers_step_runs_packed_documents_as_if_each_ran_alone():
    """data.reset_attention_mask reaches the hybrid model as document ids: the summed loss of a row
    holding two documents is the two documents' losses run apart (the Mamba state restarts, attention
    stays within each; eod_mask_loss drops the label across the boundary)."""
    from tessera.common.models.hybrid.model import build_model
    from tessera.trainer.components.precision.mixed import Precision
    from tessera.trainer.objectives.documents import IGNORE_INDEX, DocumentMasking
    from tessera.trainer.objectives.loss import cross_entropy_loss
    from tessera.trainer.objectives.step import TrainStep

    cfg = HybridConfig.model_validate({**HYBRID, "vocab_size": 64})
    model = build_model(cfg, seed=0)
    masking = DocumentMasking(eod_id=0, reset_attention_mask=True, eod_mask_loss=True)
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.0), Precision("fp32", torch.device("cpu")), 1.0,
                     documents=masking)
    g = torch.Generator().manual_seed(0)
    first, second = torch.randint(1, 64, (1, 11), generator=g), torch.randint(1, 64, (1, 13), generator=g)
    first[0, -1] = 0  # the first document ends with its end-of-document token
    inputs = torch.cat([first, second], 1)
    labels = torch.randint(1, 64, inputs.shape, generator=g)
    with torch.no_grad():
        packed = step.loss(inputs, masking.mask_labels(inputs, labels), reduction="sum")
        apart = (cross_entropy_loss(model(first), labels[:, :11].masked_fill(first == 0, IGNORE_INDEX), reduction="sum")
                 + cross_entropy_loss(model(second), labels[:, 11:], reduction="sum"))
    torch.testing.assert_close(packed, apart, rtol=1e-5, atol=1e-5)
