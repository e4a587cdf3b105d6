"""The import contracts (pyproject.toml, `make lint`) see every module and bite, and the house keeps
its shape: no import circles, no crowded folders.

import-linter checks only the modules grimp finds, and grimp walks regular packages: a folder
without `__init__.py` (common/parallel/ and trainer/parallel/ once were) is silently skipped, so a
forbidden import there passed `make lint`. The first test compares every .py file under
packages/ and kernels/ with the graph; the lint tests run lint-imports on a copy of the tree with a
forbidden import added inside a `parallel/` folder and expect it to fail (and to pass unchanged,
so the failure is the import's). The last two hold the layout of docs/architecture.md: modules
that import each other (directly or through others) are one concept split in two or two concepts
tangled, and a folder of many flat modules hides which role each plays.
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


# Known today, being fixed on other branches; the lead empties these at merge (a listed exception
# that no longer occurs fails the test, so the lists cannot go stale).
KNOWN_CYCLES_TODAY: list[set[str]] = []
MAX_FLAT_MODULES = 15
KNOWN_CROWDED_TODAY: set[str] = set()


def import_cycles() -> list[set[str]]:
    """The strongly connected components of more than one module in the project's import graph
    (type-checking imports included): a module's component is itself plus every module it
    imports, directly or not, that also imports it."""
    graph = grimp.build_graph(*root_packages(), cache_dir=None)
    cycles: list[set[str]] = []
    seen: set[str] = set()
    for module in sorted(graph.modules):
        if module in seen:
            continue
        component = {module} | (graph.find_upstream_modules(module) & graph.find_downstream_modules(module))
        seen |= component
        if len(component) > 1:
            cycles.append(component)
    return cycles


def test_no_module_of_the_project_is_in_an_import_cycle():
    cycles = import_cycles()
    new = [sorted(c) for c in cycles if c not in KNOWN_CYCLES_TODAY]
    assert not new, f"modules that import each other (directly or through others): {new}"
    gone = [sorted(c) for c in KNOWN_CYCLES_TODAY if c not in cycles]
    assert not gone, f"no longer a cycle: remove it from KNOWN_CYCLES_TODAY: {gone}"


def test_no_package_folder_holds_more_than_15_modules_flat():
    flat: dict[str, list[str]] = {}
    for path in source_modules().values():
        if path.name != "__init__.py":
            flat.setdefault(str(path.parent.relative_to(REPO)), []).append(path.stem)
    crowded = {folder: len(names) for folder, names in flat.items() if len(names) > MAX_FLAT_MODULES}
    new = {folder: n for folder, n in crowded.items() if folder not in KNOWN_CROWDED_TODAY}
    assert not new, f"folders of more than {MAX_FLAT_MODULES} modules (split them by role): {new}"
    gone = sorted(KNOWN_CROWDED_TODAY - set(crowded))
    assert not gone, f"no longer crowded: remove from KNOWN_CROWDED_TODAY: {gone}"
