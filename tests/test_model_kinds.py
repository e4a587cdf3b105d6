"""The model-kind registry (tessera.common.models.registry) as the stages meet it: each CLI refuses a
kind it does not handle in one line, before any work, and the causal LM goes through it."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Literal

import pytest
import yaml

from tessera.common.config import StrictModel
from tessera.common.errors import UserError, run_cli
from tessera.common.models import registry
from tessera.common.models.kind import ModelKind, StageHooks

sys.path.insert(0, str(Path(__file__).parent / "ckpt_convert"))
from ckpt_helpers import make_checkpoint, tiny_llama  # noqa: E402


def _cli(main, argv: list, capsys) -> str:
    """Run a CLI entry in process; it must exit 2 with one stderr line, which is returned."""
    with pytest.raises(SystemExit) as exc:
        run_cli(main, [str(a) for a in argv])
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def _train_main():
    from tessera.trainer.cli import main

    return main


def _plan_main():
    from tessera.trainer.plan.cli import main

    return main


def _ckpt_main():
    from tessera.ckpt_convert.cli import run

    return run


def _serve_main():
    from tessera.inference.entrypoints.serve_cli import main

    return main


def _train_config(path: Path, model: dict) -> Path:
    """A train config whose data does not exist: a refusal of the kind must come first."""
    path.write_text(yaml.safe_dump({"run_dir": str(path.parent / "run"), "model": model,
                                    "data": {"mixture": str(path.parent / "no-mixture"),
                                             "tokenizer": str(path.parent / "no-tokenizer")}}))
    return path


def _checkpoint_of_kind(root: Path, model: dict | None) -> Path:
    """A tiny causal-LM checkpoint whose sidecar then says `model` (None: drop the `kind` field)."""
    make_checkpoint(root, tiny_llama(num_layers=1), None)
    sidecar = root / "iter_0000010" / "tessera_checkpoint.json"
    data = json.loads(sidecar.read_text())
    data["model"] = {k: v for k, v in data["model"].items() if k != "kind"} if model is None else model
    sidecar.write_text(json.dumps(data))
    return root


def test_the_trainer_checks_configs_against_the_names_its_objectives_have():
    """The light check a config meets (tessera.trainer.kinds.TRAINED) and the objectives' tables
    (tessera.trainer.objectives.registry) name the same hooks, and each entry loads."""
    from tessera.trainer.kinds import TRAINED
    from tessera.trainer.objectives.registry import BATCHES, LOSSES, OBJECTIVES

    assert set(BATCHES) == set(LOSSES) == set(OBJECTIVES) == set(TRAINED)
    for table in (BATCHES, LOSSES, OBJECTIVES):
        assert all(isinstance(load(), type) for load in table.values())


def test_the_causal_lm_goes_through_the_registry_and_every_stage_has_its_code():
    from tessera.ckpt_convert.kinds import CONVERTERS, check_convertible
    from tessera.common.models.causal_lm.config import ModelConfig
    from tessera.common.models.causal_lm.model import Transformer
    from tessera.inference.core.block_manager import BlockManager
    from tessera.inference.worker.kinds import serving_kind
    from tessera.inference.worker.pooling.runner import DecoderRunner
    from tessera.trainer.objectives.batches import MixtureBatches
    from tessera.trainer.objectives.registry import trainer_kind
    from tessera.trainer.objectives.step import TrainStep
    from tessera.trainer.plan.memory import decoder_memory, memory_count

    assert list(registry.KINDS) == ["causal_lm", "hybrid", "encoder", "vision_language", "encoder_decoder"]
    cfg = tiny_llama(num_layers=1)
    kind = registry.kind_of(cfg)
    assert kind.config is ModelConfig and cfg.kind == "causal_lm"
    assert isinstance(kind.build(cfg, seed=0), Transformer)
    assert kind.flops_per_token(cfg, 64) == cfg.flops_per_token(64)
    assert trainer_kind(cfg).batches is MixtureBatches and trainer_kind(cfg).step is TrainStep
    assert serving_kind(cfg).runner is DecoderRunner and serving_kind(cfg).cache is BlockManager
    assert memory_count(cfg) is decoder_memory
    for conversion in CONVERTERS["decoder"]:
        check_convertible(cfg, conversion)
    plan = kind.parallel()
    assert set(plan.column) == {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "q_b_proj", "kv_b_proj"}
    assert set(plan.row) == {"o_proj", "down_proj"} and plan.layers == "layers"


def test_a_config_or_checkpoint_without_a_kind_is_a_causal_lm(tmp_path, capsys):
    from tessera.ckpt_convert.cli import main
    from tessera.common.checkpoint import read_sidecar

    assert registry.model_config({"preset": "tiny", "vocab_size": 64}).kind == "causal_lm"
    ck = _checkpoint_of_kind(tmp_path / "ck", None)  # a sidecar written before the field existed
    assert read_sidecar(ck / "iter_0000010").model.kind == "causal_lm"
    with pytest.raises(SystemExit) as exc:
        main(["info", str(ck)])
    assert exc.value.code == 0 and "causal_lm" not in capsys.readouterr().err


def test_the_kind_is_recorded_in_sidecars_and_derived_from_hf_architectures(tmp_path):
    make_checkpoint(tmp_path / "ck", tiny_llama(num_layers=1), None)
    sidecar = json.loads((tmp_path / "ck" / "iter_0000010" / "tessera_checkpoint.json").read_text())
    assert sidecar["model"]["kind"] == "causal_lm"
    assert registry.kind_for_hf({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}, "c").name == "causal_lm"
    assert registry.kind_for_hf({"model_type": "gpt2"}, "c").name == "causal_lm"  # no architectures: by model_type
    assert registry.kind_for_hf({"model_type": "llama", "architectures": ["LlamaModel"]}, "c").name == "causal_lm"


def test_every_cli_refuses_an_unregistered_kind_in_one_line_before_any_work(tmp_path, capsys):
    diffusion = {"kind": "diffusion", "vocab_size": 320, "hidden_size": 64}
    config = _train_config(tmp_path / "train.yaml", {"preset": "tiny", "kind": "diffusion"})
    for main in (_train_main(), _plan_main()):
        err = _cli(main, ["--config", config], capsys)
        assert "model.kind: model kind 'diffusion' is not one Tessera has (registered: causal_lm, hybrid, encoder, vision_language, encoder_decoder)" in err, err
    assert not (tmp_path / "run").exists()

    ck = _checkpoint_of_kind(tmp_path / "ck", diffusion)
    for argv in (["export", "--format", "hf"], ["export", "--format", "trtllm"], ["export", "--format", "megatron"],
                 ["reshard", "--tensor-parallel", "1", "--pipeline-parallel", "1"]):
        err = _cli(_ckpt_main(), [*argv, "--checkpoint", ck, "--output", tmp_path / "out"], capsys)
        assert "tessera_checkpoint.json: model.kind: model kind 'diffusion' is not one Tessera has" in err, err
        assert not (tmp_path / "out").exists()
    err = _cli(_serve_main(), ["--checkpoint", ck], capsys)
    assert "model kind 'diffusion' is not one Tessera has" in err, err

    whisper = tmp_path / "whisper"
    whisper.mkdir()
    (whisper / "config.json").write_text(json.dumps({"model_type": "whisper",
                                                     "architectures": ["WhisperForConditionalGeneration"]}))
    (whisper / "model.safetensors").write_bytes(b"\0" * 16)  # never read
    for main, argv in ((_ckpt_main(), ["import", "--format", "hf", "--input", whisper, "--output", tmp_path / "out"]),
                       (_serve_main(), ["--checkpoint", whisper])):
        err = _cli(main, argv, capsys)
        assert "config.json: unsupported architecture 'whisper' (WhisperForConditionalGeneration), of no model kind Tessera has" in err
    assert not (tmp_path / "out").exists()


class _EncoderConfig(StrictModel):
    kind: Literal["test_encoder"] = "test_encoder"
    vocab_size: int = 320
    max_seq_len: int = 64


def _not_reached(*_args, **_kwargs):
    raise AssertionError("a stage worked on a kind it does not handle")


@pytest.fixture
def unhandled_kind(monkeypatch):
    """A registered kind no stage has code for (what a new kind is before its stage code lands)."""
    kind = ModelKind(name="test_encoder", description="a kind with no stage code", config=_EncoderConfig,
                     build=_not_reached, hf=_not_reached, parallel=_not_reached, flops_per_token=_not_reached,
                     hooks=StageHooks())
    monkeypatch.setitem(registry.KINDS, kind.name, kind)
    return kind


def test_a_stage_without_code_for_a_registered_kind_refuses_it_in_one_line_before_any_work(
        tmp_path, capsys, unhandled_kind):
    from tessera.trainer.plan.memory import memory_count

    config = _train_config(tmp_path / "train.yaml", {"kind": "test_encoder"})
    for main in (_train_main(), _plan_main()):
        err = _cli(main, ["--config", config], capsys)
        assert ("model kind 'test_encoder': tessera-train has no batch builder for it (tessera-train handles "
                "causal_lm, hybrid, encoder, vision_language, encoder_decoder)") in err, err
    assert not (tmp_path / "run").exists()
    with pytest.raises(UserError, match="'test_encoder': tessera-plan has no memory count for it"):
        memory_count(_EncoderConfig())

    ck = _checkpoint_of_kind(tmp_path / "ck", {"kind": "test_encoder"})
    for argv, conversion in ((["export", "--format", "hf"], "export --format hf"),
                             (["export", "--format", "trtllm"], "export --format trtllm"),
                             (["export", "--format", "megatron"], "export --format megatron"),
                             (["reshard", "--tensor-parallel", "1", "--pipeline-parallel", "1"], "reshard")):
        err = _cli(_ckpt_main(), [*argv, "--checkpoint", ck, "--output", tmp_path / "out"], capsys)
        handled = {"export --format trtllm": "causal_lm", "export --format megatron": "causal_lm, hybrid, encoder",
                   "import --format megatron": "causal_lm, hybrid, encoder",
                   "export --format hf": "causal_lm, hybrid, encoder, vision_language, encoder_decoder",
                   "reshard": "causal_lm, hybrid, encoder, vision_language, encoder_decoder"}.get(
                       conversion, "causal_lm, hybrid, encoder, encoder_decoder")
        assert (f"model kind 'test_encoder': tessera-ckpt {conversion} has no converter for it "
                f"(tessera-ckpt {conversion} handles {handled})") in err, err
        assert not (tmp_path / "out").exists()
    err = _cli(_serve_main(), ["--checkpoint", ck], capsys)
    assert "model kind 'test_encoder': tessera-serve has no model runner for it (tessera-serve handles causal_lm, " \
        "hybrid, encoder, vision_language, encoder_decoder)" in err, err


HYBRID = {"kind": "hybrid", "arch": "mamba2", "vocab_size": 320, "hidden_size": 32, "num_layers": 2, "pattern": "MM",
          "mamba": {"num_heads": 4, "head_dim": 16, "state_size": 8, "num_groups": 2}}


def test_the_hybrid_kind_is_registered_and_every_stage_without_its_code_refuses_it_in_one_line(tmp_path, capsys):
    from tessera.common.models.hybrid.model import HybridModel

    cfg = registry.model_config(HYBRID)
    assert registry.kind_of(cfg).name == "hybrid" and isinstance(registry.kind_of(cfg).build(cfg, seed=0), HybridModel)
    for archs in (["NemotronHForCausalLM"], ["NemotronHModel"], None):  # the causal LM claims every *ForCausalLM
        assert registry.kind_for_hf({"model_type": "nemotron_h", "architectures": archs}, "c").name == "hybrid"
    # tessera-train and tessera-plan handle it (tests/trainer/test_hybrid_training.py, test_hybrid_plan.py)
    bad = _train_config(tmp_path / "bad.yaml", {**HYBRID, "pattern": "M+"})
    err = _cli(_train_main(), ["--config", bad], capsys)
    assert "model: Value error, pattern: '+' (layer 1) is not a layer symbol; use M (Mamba-2), * (attention), - (MLP), E (MoE)" in err
    assert not (tmp_path / "run").exists()

    # tessera-ckpt (tests/ckpt_convert/test_hybrid_*.py) and tessera-serve (tests/inference/test_hybrid_*.py)
    # handle it; what is left to check is the sidecar against the tensors.
    ck = _checkpoint_of_kind(tmp_path / "ck", HYBRID)  # a hybrid sidecar over a causal LM's tensors
    err = _cli(_ckpt_main(), ["export", "--format", "hf", "--checkpoint", ck, "--output", tmp_path / "out"], capsys)
    # The kind's tensor map is checked against the index before anything else reads the checkpoint.
    assert "model tensor 'embed_tokens.weight' has shape [320, 64], the sidecar's model config implies [320, 32]" \
        in err, err


LAYOUT_REFUSALS = [  # (kind's model section, layout, the kind's own line)
    (HYBRID, dict(context=4), "--context-parallel 4 x --tensor-parallel 1 must divide model.mamba.num_groups (2)"),
    (HYBRID, dict(tensor=8), "must divide model.mamba.num_heads (4)"),
    ({"kind": "encoder_decoder", "vocab_size": 64, "d_model": 32, "d_kv": 8, "d_ff": 48, "num_layers": 2,
      "num_decoder_layers": 2, "num_heads": 4}, dict(context=2), "not built for the encoder-decoder kind (T5)"),
    ({"kind": "vision_language", "image_token_id": 3,
      "vision": {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "ffn_hidden_size": 64, "image_size": 16,
                 "patch_size": 8},
      "text": {"vocab_size": 64, "hidden_size": 32, "num_layers": 2, "num_heads": 4, "num_kv_heads": 4,
               "ffn_hidden_size": 64, "max_seq_len": 64}}, dict(tensor=4), "must divide model.vision.num_heads (2)"),
    # FSDP x TP: the tower's split weights are sharded along its width (34), which 4 shards do not
    # divide (the LM's 32 they do): the kind's line, not FSDP's error at the first step.
    ({"kind": "vision_language", "image_token_id": 3,
      "vision": {"hidden_size": 34, "num_layers": 2, "num_heads": 2, "ffn_hidden_size": 64, "image_size": 16,
                 "patch_size": 8},
      "text": {"vocab_size": 64, "hidden_size": 32, "num_layers": 2, "num_heads": 4, "num_kv_heads": 4,
               "ffn_hidden_size": 64, "max_seq_len": 64}}, dict(tensor=2, data=4, data_shard=4),
     "--data-shard 4 with --tensor-parallel 2 must divide model.vision.hidden_size (34)"),
]


@pytest.mark.parametrize("model, layout, line", LAYOUT_REFUSALS, ids=["hybrid cp", "hybrid tp", "t5 cp", "vlm tp", "vlm fsdp x tp"])
def test_validate_layout_names_no_kind_and_each_kind_refuses_what_it_lacks_through_its_own_config(model, layout, line):
    from tessera.common import layout as layout_module
    from tessera.common.layout import ParallelLayout, validate_layout

    source = Path(layout_module.__file__).read_text()
    assert not [k for k in registry.KINDS if k != "causal_lm" and k in source], "per-kind code belongs to the kind"
    with pytest.raises(UserError) as exc:
        validate_layout(registry.model_config(model), ParallelLayout(**layout))
    assert line in str(exc.value) and "\n" not in str(exc.value), exc.value
