"""The import contracts (pyproject.toml, `make lint`) see every module and bite.

import-linter checks only the modules grimp finds, and grimp walks regular packages: a folder
without `__init__.py` (common/parallel/ and trainer/parallel/ once were) is silently skipped, so a
forbidden import there passed `make lint`. The first test compares every .py file under
packages/ and kernels/ with the graph; the others run lint-imports on a copy of the tree with a
forbidden import added inside a `parallel/` folder and expect it to fail (and to pass unchanged,
so the failure is the import's).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import grimp
import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10 (import-linter depends on tomli there)
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]
# Each holds one portion of the `tessera` namespace package: <root>/tessera/<package>/...
SOURCE_ROOTS = [REPO / "kernels", *sorted(p.parent for p in (REPO / "packages").glob("*/pyproject.toml"))]


def root_packages() -> list[str]:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
    return config.get("root_packages") or [config["root_package"]]


def source_modules() -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of the installable packages."""
    out = {}
    for root in SOURCE_ROOTS:
        for path in (root / "tessera").rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def test_every_module_under_packages_and_kernels_is_in_the_import_graph():
    modules = source_modules()
    assert "tessera.common.parallel.layers" in modules and "tessera.trainer.parallel.runtime" in modules
    graph = grimp.build_graph(*root_packages(), cache_dir=None)  # what lint-imports analyses
    invisible = sorted(str(modules[m].relative_to(REPO)) for m in set(modules) - graph.modules)
    assert not invisible, (f"{len(invisible)} module(s) the import contracts cannot see (a folder without "
                           f"__init__.py?): {invisible}")


def lint_copy(tmp_path: Path, probes: dict[str, str]) -> subprocess.CompletedProcess:
    """lint-imports over a copy of packages/ and kernels/ plus `probes` (path under packages/ ->
    source), run with `python -S` so the editable installs (which point at this checkout) stay out
    of the way: sys.path is the copy's roots, then site-packages for import-linter itself."""
    copy = tmp_path / "repo"
    roots = []
    for root in SOURCE_ROOTS:
        target = copy / root.relative_to(REPO)
        shutil.copytree(root / "tessera", target / "tessera", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        roots.append(str(target))
    shutil.copy(REPO / "pyproject.toml", copy / "pyproject.toml")
    for rel, source in probes.items():
        (copy / "packages" / rel).write_text(source)
    paths = roots + sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    code = ("import sys; sys.path[:0] = " + repr(paths) + "\n"
            "from importlinter.cli import lint_imports\n"
            "sys.exit(lint_imports(config_filename='pyproject.toml', no_cache=True, no_logo=True))\n")
    return subprocess.run([sys.executable, "-S", "-c", code], cwd=copy, capture_output=True, text=True, timeout=120)


def test_lint_imports_passes_on_an_unchanged_copy(tmp_path):
    proc = lint_copy(tmp_path, {})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"Analyzed {len(source_modules()) + 1} files" in proc.stdout  # every module, plus the namespace


@pytest.mark.parametrize("probe, source, contract", [
    ("common/tessera/common/parallel/probe.py", "from tessera.trainer.parallel import runtime\n",
     "Shared packages never import a stage package"),
    ("trainer/tessera/trainer/parallel/probe.py", "import tessera.inference.engine.llm_engine\n",
     "Stage packages are independent"),
    ("ckpt_convert/tessera/ckpt_convert/probe.py", "from tessera.trainer.parallel.pipeline import build_stages\n",
     "Stage packages are independent"),
], ids=["common-parallel-imports-trainer", "trainer-parallel-imports-inference", "ckpt-imports-trainer-parallel"])
def test_a_forbidden_import_in_a_parallel_folder_fails_lint(tmp_path, probe, source, contract):
    proc = lint_copy(tmp_path, {probe: source})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    module = "tessera." + probe.split("/tessera/", 1)[1].removesuffix(".py").replace("/", ".")
    broken = out.split("Broken contracts", 1)[-1]  # the report after the summary
    assert contract in broken and f"{module} -> " in broken, out[-3000:]
