"""benchmarks/gpu_session.py, the plan of one 15-minute GPU lease, checked on CPU: its dry run
passes with the carried wheels present and refuses in one line per problem (wheels missing, caps
over 13 minutes or over one call, a flag a script does not have); its closing table reads the
figures a finished run left and says which goals were met."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_session.py"


@pytest.fixture(scope="module")
def session():
    spec = importlib.util.spec_from_file_location("bench_gpu_session", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def wheels(tmp_path, session):
    """A wheel folder as --fetch-wheels leaves it (names only: the dry run reads names)."""
    folder = tmp_path / "whl"
    folder.mkdir()
    for name in session.WHEELS:
        (folder / f"{name}-1.0-py3-none-any.whl").touch()
    for spec in session.TITAN_WHEELS:
        name, version = spec.split("==")
        (folder / f"{name}-{version}-py3-none-any.whl").touch()
    return folder


def test_the_dry_run_passes_with_the_wheels_and_fits_thirteen_minutes_in_two_calls(session, wheels, capsys):
    assert session.main(["--dry-run", "--wheels", str(wheels)]) == 0
    assert f"of {13 * 60} s" in capsys.readouterr().out
    assert sum(s.cap_s for s in session.PLAN) <= 13 * 60
    assert {s.part for s in session.PLAN} == {1, 2}
    for part in (1, 2):
        assert sum(s.cap_s for s in session.PLAN if s.part == part) <= 600 - 30
    first = [s.name for s in session.PLAN]
    assert first[:2] == ["install", "tests"], "the gpu tests run first, then the benchmarks"


def test_the_dry_run_names_each_missing_wheel_and_exits_2(session, wheels, capsys):
    (wheels / "torchao-1.0-py3-none-any.whl").unlink()
    assert session.main(["--dry-run", "--wheels", str(wheels)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no wheel for torchao" in err[0] and "--fetch-wheels" in err[0]


def test_the_dry_run_names_a_missing_torchtitan_release_by_its_version(session, wheels, capsys):
    (wheels / "torchtitan-0.2.2-py3-none-any.whl").unlink()
    (wheels / "torchtitan-0.2.1-py3-none-any.whl").touch()  # another release does not stand in for it
    assert session.main(["--dry-run", "--wheels", str(wheels)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no wheel for torchtitan==0.2.2" in err[0]


class FakeMachine:
    """pip and Python on a GPU machine whose torch imports only the torchtitan releases in `imports`."""

    def __init__(self, imports: set[str]):
        self.imports, self.installed, self.pip_calls = imports, None, []

    def run(self, argv, **kwargs):
        import subprocess

        if argv[1:4] == ["-m", "pip", "install"]:
            self.installed = Path(argv[-1]).name.split("-")[1]
            self.pip_calls.append(self.installed)
            return subprocess.CompletedProcess(argv, 0, "", "")
        assert argv[1] == "-c" and "import torchtitan.train" in argv[2]
        if self.installed in self.imports:
            return subprocess.CompletedProcess(argv, 0, "2.11.0+cu130\n", "")
        return subprocess.CompletedProcess(argv, 1, "2.11.0+cu130\n", "Traceback (most recent call last):\n  ...\n"
                                           "ImportError: cannot import name 'DataParallelMeshDims' from "
                                           "'torch.distributed.fsdp'\n")


def test_torchtitan_install_keeps_the_newest_release_that_imports_and_says_why_the_others_were_skipped(
        session, wheels, monkeypatch, capsys):
    machine = FakeMachine(imports={"0.2.2"})
    monkeypatch.setattr(session.subprocess, "run", machine.run)
    assert session.main(["--install-torchtitan", "--wheels", str(wheels)]) == 0
    assert machine.pip_calls == ["0.3.0", "0.2.2"], "newest first, and no further once one imports"
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "torchtitan 0.2.2: its trainer imports on torch 2.11.0+cu130; installed"
    assert out[1] == ("  skipped torchtitan 0.3.0: import torchtitan.train fails on torch 2.11.0+cu130: ImportError: "
                      "cannot import name 'DataParallelMeshDims' from 'torch.distributed.fsdp'")


def test_torchtitan_install_fails_with_each_releases_reason_when_none_imports(session, wheels, monkeypatch, capsys):
    machine = FakeMachine(imports=set())
    monkeypatch.setattr(session.subprocess, "run", machine.run)
    assert session.main(["--install-torchtitan", "--wheels", str(wheels)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "gpu_session: no carried torchtitan imports here"
    assert [line.split(":")[0] for line in out[1:]] == ["  torchtitan 0.3.0", "  torchtitan 0.2.2"]


def test_a_plan_over_its_budget_or_naming_an_unknown_flag_is_refused(session, wheels, monkeypatch):
    plan = list(session.PLAN)
    slow = dataclasses.replace(plan[2], cap_s=plan[2].cap_s + 200)
    typo = dataclasses.replace(plan[3], argv=(*plan[3].argv, "--no-such-flag"))
    monkeypatch.setattr(session, "PLAN", (*plan[:2], slow, typo, *plan[4:]))
    problems = session.check_plan(wheels)
    assert any("over the 780 s budget" in p for p in problems)
    assert any("part 1" in p and "over one call" in p for p in problems)
    assert any("has no --no-such-flag option" in p for p in problems)


def _serving_client():
    spec = importlib.util.spec_from_file_location("bench_serving_client", SCRIPT.parent / "serving_client.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_table_reads_a_finished_runs_figures_and_says_what_was_met(session, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "tests.log").write_text("....\n49 passed, 5 skipped in 98.1s\n")
    (out / "train1b-bf16.json").write_text(json.dumps({"ratio": 1.52, "results": {"tessera": {
        "tokens_per_s": 60000.0, "mfu_bf16_peak": 0.561}}}))
    (out / "train1b-fp8.json").write_text(json.dumps({"results": {"tessera": {
        "tokens_per_s": 66000.0, "first_step_s": 75.0}}}))
    (out / "serve1b.log").write_text("  TPOT median / physical floor: 2.7x\n  client: 8 process(es) (aiohttp 3.14.5, "
                                     "uvloop), CPU per output token 9.1 us, busiest process 23% of its wall\n  "
                                     + _serving_client().describe_server({"processes": [
                                         {"role": "HTTP process", "utilisation": 0.97},
                                         {"role": "engine process", "utilisation": 0.64}],
                                         "busiest_role": "HTTP process", "busiest_utilisation": 0.97}) + "\n")
    rows = {name: (value, met) for name, value, _, met in session.figures(out)}
    assert rows["gpu tests"] == ("49 passed, 5 skipped in 98.1s", "yes")
    assert rows["llama-1b bf16 MFU"] == ("56.1%", "yes")
    assert rows["llama-1b fp8 / bf16"] == ("1.10x", "no")
    assert rows["fp8 first step (s)"] == ("75", "no")
    assert rows["serve1b TPOT / HBM floor"] == ("2.7x", "yes")
    assert rows["serve1b client busiest"] == ("23%", "yes")  # under 80%: the TPOT is the server's
    assert rows["serve160m client busiest"] == ("not measured", "no")
    assert rows["serve1b server busiest"] == ("HTTP process 97%", "-")
    assert rows["8B-shaped fp8 / bf16"] == ("not measured", "no")
    session.print_table(session.figures(out))
    assert capsys.readouterr().out.splitlines()[0].split() == ["figure", "value", "goal", "met"]


def test_the_gpu_step_breakdown_sorts_kernels_by_kind_and_counts_the_gaps_as_idle():
    spec = importlib.util.spec_from_file_location("bench_step_breakdown", SCRIPT.parent / "step_breakdown.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    kernels = [("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n", 0.0, 100.0),
               ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16", 100.0, 150.0),
               ("triton_red_fused__log_softmax_nll_loss_forward_0", 150.0, 160.0),
               ("void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor>", 200.0, 220.0),
               ("triton_per_fused_add_rms_norm_1", 220.0, 230.0),
               ("triton_poi_fused_mul_silu_2", 225.0, 240.0)]  # overlaps the norm: counted once in busy time
    b = module.split_kernels(kernels, wall_ms=0.3)
    assert b["kinds_ms"] == pytest.approx({"attention": 0.05, "gemm": 0.1, "loss": 0.01, "optimizer": 0.02,
                                           "norms": 0.01, "elementwise": 0.015})
    assert b["idle_ms"] == pytest.approx(0.3 - 0.2)  # busy 0-160, 200-240
