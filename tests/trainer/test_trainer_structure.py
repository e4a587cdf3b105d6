"""The trainer's house (issue 27): each config concept defined once, a config module light enough
to load without torch, the MoE router statistics in the step result, and float8 reached only
through the backend the config names. (Folder sizes and import cycles: tests/test_import_contracts.py.)"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import tessera.trainer
from tessera.trainer.cli import main

TRAINER = Path(tessera.trainer.__file__).parent


def test_every_config_class_of_the_trainer_is_defined_once():
    """One name per concept: the parallel runtime takes TrainConfig's sections instead of copies."""
    where: dict[str, list[str]] = {}
    for path in TRAINER.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.name.endswith(("Config", "ConfigSection")):
                where.setdefault(node.name, []).append(str(path.relative_to(TRAINER)))
    twice = {name: paths for name, paths in where.items() if len(paths) > 1}
    assert not twice, f"config classes defined more than once: {twice}"
    assert "ParallelConfigSection" not in where


def test_the_trainer_config_module_loads_without_torch():
    """`tessera-train --help` and config validation read only the schemas."""
    code = "import sys, tessera.trainer.config; print(sorted(m for m in ('torch', 'torchao') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


def _records(run_dir: Path, kind: str = "train") -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def test_router_statistics_reach_the_log_in_the_step_result_of_any_engine(make_config, tmp_path):
    """An engine that returns them only in its StepResult (no attribute for the loop to read aside)."""
    import yaml

    from tessera.trainer.components.distributed import init_runtime
    from tessera.trainer.config import TrainConfig
    from tessera.trainer.inputs import check_inputs
    from tessera.trainer.trainer import Trainer, build_engine

    class ProbeEngine:
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def train_step(self, tokens, labels):
            return dataclasses.replace(self.inner.train_step(tokens, labels), router={"moe_probe": 1.5})

    cfg = TrainConfig.model_validate(yaml.safe_load(make_config().read_text()))
    cfg.training.steps = 2
    inputs, runtime = check_inputs(cfg), init_runtime("cpu")
    Trainer(cfg, inputs, runtime, quiet=True, engine=ProbeEngine(build_engine(cfg, inputs, runtime))).train()
    assert [r["moe_probe"] for r in _records(tmp_path / "run")] == [1.5, 1.5]


class _FakeFloat8:
    """A float8 backend that records what the trainer asks of it and converts nothing."""

    recipes = ("tensorwise",)

    def __init__(self):
        self.calls: list[str] = []

    def problem(self, training, model, device, processes):
        self.calls.append(f"problem {training.fp8_recipe} {processes}")
        return None

    def convert(self, model, recipe, fsdp_float8_all_gather=False):
        self.calls.append(f"convert {recipe}")
        return ["probe"]

    def forward_context(self, recipe):
        @contextlib.contextmanager
        def entered():
            self.calls.append("forward")
            yield
        return entered

    def after_optimizer_step(self, model):
        self.calls.append("stepped")


def test_an_fp8_run_reaches_float8_only_through_the_backend_its_config_names(make_config, tmp_path, monkeypatch):
    from tessera.trainer.components.precision import float8

    chosen, other = _FakeFloat8(), _FakeFloat8()
    monkeypatch.setattr(float8, "_BACKENDS", {"torchao": other, "te": chosen})
    assert main(["--config", str(make_config()), "training.precision=fp8", "training.fp8_backend=te",
                 "training.steps=1", "--quiet"]) == 0
    assert other.calls == []
    assert chosen.calls[:2] == ["problem tensorwise 1", "convert tensorwise"]
    assert chosen.calls.count("stepped") == 1
    assert chosen.calls.count("forward") == 2, "one forward per micro-batch of the one step"
    assert [r["step"] for r in _records(tmp_path / "run")] == [1]
