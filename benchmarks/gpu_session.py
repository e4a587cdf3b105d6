"""One GPU lease in two device calls: the plan, its time caps, the run, and one closing table.

A lease is 15 minutes of device time, the machine's start (1-2 min) included, at most 10 minutes a
call and a 30 s gap before the machine goes cold. So the plan is two calls (`part 1`, `part 2`),
their caps adding up to 13 minutes or less; each step runs under its own `timeout` and a step that
fails or runs over does not stop the next. Part 2 reinstalls nothing when the machine is still
warm. Every step logs to $OUT/<step>.log (and JSON where its benchmark writes one); the last thing
each call prints is the table: figure, goal, met.

    python3 benchmarks/gpu_session.py --dry-run        # on CPU: wheels present, caps within budget
    OUT=... python3 benchmarks/gpu_session.py 1        # first device call (install, tests, llama-1b)
    OUT=... python3 benchmarks/gpu_session.py 2        # second call, within 30 s (8B-shaped fp8, serving)

Wheels: the image (Python 3.12, torch 2.11, no network) lacks the packages in WHEELS; they travel
as cp312 wheels in .whl/ (64 MiB carry), fetched on a machine with a registry by `--fetch-wheels`,
with the torchtitan peer's pure-Python wheels at the versions in TITAN_WHEELS (3 MB). The peer is
outside the plan: `--step install titan-install titan` on a lease of its own (install: a fresh machine).
This file imports nothing of Tessera: it runs before Tessera is installed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUDGET_S = 13 * 60  # 15 minutes of device time less the machine's start
CALL_LIMIT_S = 600  # the device tool's limit per call
CALL_MARGIN_S = 30  # each call's caps stay this far under the limit (process start, the table)

# What the GPU image lacks (../shared/gpu/README.md lists the set that worked on 2026-11-27).
WHEELS = ("pydantic", "pydantic_core", "annotated_types", "annotated_doc", "typing_inspection", "typing_extensions",
          "fastapi", "starlette", "uvicorn", "opentelemetry_api", "llguidance", "torchao",
          "uvloop", "httptools",  # uvicorn's loop and parser (tessera-inference's dependencies since stop 41)
          # the serving benchmarks' client (serving_client.py): aiohttp's C parser costs the client ~7x less
          # CPU per streamed token than httpx's (benchmarks/RESULTS.md); 3.1 MB with what it imports
          "aiohttp", "aiohappyeyeballs", "aiosignal", "attrs", "frozenlist", "multidict", "propcache", "yarl")
# The torchtitan peer (issue #34 item 6), pure-Python wheels at these versions: both torchtitan
# releases (`--install-torchtitan` keeps the newest that imports on the machine's torch: 0.3.0 needs
# torch 2.14, the image has 2.11, on which 0.2.2 imports; see benchmarks/torchtitan_peer.py) and
# what they import that the image lacks (0.3.0's set covers 0.2.2's; 0.2.2's tomli is stdlib tomllib
# on Python 3.12).
TITAN_WHEELS = ("torchtitan==0.3.0", "torchtitan==0.2.2", "spmd_types==0.2.3", "torch_checkpointing==0.1.1",
                "torchdata==0.11.0", "tyro==1.0.17", "docstring_parser==0.18.0", "typeguard==4.6.0",
                "datasets==4.7.0", "dill==0.4.0", "multiprocess==0.70.18")
PACKAGES = ("packages/common", "kernels", "packages/data_prep", "packages/trainer", "packages/ckpt_convert",
            "packages/inference")


@dataclass(frozen=True)
class Step:
    name: str
    part: int
    cap_s: int
    argv: tuple[str, ...]  # run from the repository root; {out} is $OUT


BENCH = ("python3", "benchmarks/")
TRAIN1B = ("--device", "cuda", "--preset", "llama-1b", "--full-size", "--seq", "4096", "--batch", "2",
           "--steps", "6", "--warmup", "2")
SERVE = ("--device", "cuda", "--no-peer", "--num-requests", "128", "--concurrency", "64", "--output-len", "128", "128",
         "--naive-requests", "2", "--rounds", "1", "--max-num-batched-tokens", "2048")
PLAN: tuple[Step, ...] = (
    Step("install", 1, 45, ("python3", "benchmarks/gpu_session.py", "--install")),
    Step("tests", 1, 100, ("python3", "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", "-rs", "tests")),
    # issue #34 item 3: MFU of llama-1b bf16 at seq 4096 beside transformers, each alone on the GPU,
    # with the step's breakdown (GEMMs, attention, loss, optimizer, elementwise, idle)
    Step("train1b-bf16", 1, 180, ("python3", "benchmarks/train_throughput.py", *TRAIN1B, "--precision", "bf16",
                                  "--separate-processes", "--breakdown", "2", "--json", "{out}/train1b-bf16.json")),
    Step("train1b-fp8", 1, 130, ("python3", "benchmarks/train_throughput.py", *TRAIN1B, "--precision", "fp8",
                                 "--fp8-recipe", "tensorwise", "--only", "tessera",
                                 "--json", "{out}/train1b-fp8.json")),
    Step("install-check", 2, 5, ("python3", "benchmarks/gpu_session.py", "--install")),
    # item 4: where GEMMs dominate: four llama3-8b layers (d 4096, ffn 14336, 32/8 heads, vocab 128256)
    Step("fp8-8b", 2, 150, ("python3", "benchmarks/fp8_convergence.py", "--device", "cuda", "--preset", "llama3-8b",
                            "--layers", "4", "--seq", "4096", "--batch", "1", "--steps", "12", "--warmup", "4",
                            "--window", "4", "--json", "{out}/fp8-8b.json")),
    # item 5: decode next to the HBM floor at 64 concurrent. SERVE: every request 128 tokens, so the
    # 64 streams start, decode 64 wide and end together (two waves of 127 steps), not a batch that
    # shrinks and refills with prefills; the naive peer's 2 x 128 tokens cost what 4 x [8, 128] did.
    Step("serve1b", 2, 110, ("python3", "benchmarks/serving.py", "--preset", "llama-1b", *SERVE)),
    # at 160m the host's work is the TPOT: the engine's step overlapped with the forward
    # (--async-scheduling) and the streams' HTTP work over 4 processes (--api-server-count; one took
    # ~1.7 ms of CPU per 64 streamed tokens on the CPU box, more than a 160m step on an H100).
    # serve160m-sync below is the same with neither; each log names the busiest server process.
    Step("serve160m", 2, 60, ("python3", "benchmarks/serving.py", "--preset", "llama-160m", *SERVE,
                              "--async-scheduling", "--api-server-count", "4")),
)

# Outside the 15-minute plan, run by name (`--step NAME`) on a longer lease or a second one.
EXTRAS: tuple[Step, ...] = (
    Step("kernels", 0, 300, ("python3", "benchmarks/kernels.py", "--dtype", "bf16")),
    Step("train1b-fp8-rowwise", 0, 300, ("python3", "benchmarks/train_throughput.py", *TRAIN1B, "--precision", "fp8",
                                         "--fp8-recipe", "rowwise", "--only", "tessera",
                                         "--json", "{out}/train1b-fp8-rowwise.json")),
    # Transformer Engine must be preinstalled on the machine (its CUDA wheels exceed the carry);
    # without it the trainer's one line says so
    Step("train1b-te", 0, 500, ("python3", "benchmarks/train_throughput.py", *TRAIN1B, "--precision", "fp8",
                                "--fp8-backend", "te", "--fp8-recipe", "tensorwise", "--no-compile",
                                "--separate-processes", "--json", "{out}/train1b-te.json")),
    # item 3's levers, each against the plan's train1b-bf16 figure: cuDNN's attention kernel, then
    # the loss in 8k-token chunks over the 128k vocabulary (training.attention_backend, loss_chunk_tokens)
    Step("train1b-cudnn", 0, 150, ("python3", "benchmarks/train_throughput.py", *TRAIN1B, "--precision", "bf16",
                                   "--only", "tessera", "--attention-backend", "cudnn",
                                   "--json", "{out}/train1b-cudnn.json")),
    Step("train1b-chunked-loss", 0, 150, ("python3", "benchmarks/train_throughput.py", *TRAIN1B, "--precision",
                                          "bf16", "--only", "tessera", "--loss-chunk-tokens", "8192",
                                          "--json", "{out}/train1b-chunked-loss.json")),
    # the whole-graph compile (forward + loss, as before training.compile_scope) against the plan's
    # default per-block compile: first step and steady step
    Step("train1b-whole-graph", 0, 150, ("python3", "benchmarks/train_throughput.py", *TRAIN1B, "--precision",
                                         "bf16", "--only", "tessera", "--compile-scope", "model",
                                         "--json", "{out}/train1b-whole-graph.json")),
    # item 4's convergence line: 200 steps of llama-1b, fp8 within 1% of bf16
    Step("fp8-convergence", 0, 500, ("python3", "benchmarks/fp8_convergence.py", "--device", "cuda", "--preset",
                                     "llama-1b", "--seq", "4096", "--batch", "2", "--steps", "200",
                                     "--json", "{out}/fp8-convergence.json")),
    # item 6: run as `--step install titan-install titan`: the newest carried torchtitan that imports on the
    # machine's torch (0.2.2 on the image's 2.11: 0.3.0 failed at import there on 2026-11-27)
    Step("titan-install", 0, 60, ("python3", "benchmarks/gpu_session.py", "--install-torchtitan")),
    Step("titan", 0, 500, ("python3", "benchmarks/torchtitan_peer.py", "--steps", "30", "--warmup", "10",
                           "--json", "{out}/torchtitan.json")),
    Step("serve160m-sync", 0, 60, ("python3", "benchmarks/serving.py", "--preset", "llama-160m", *SERVE)),
    Step("serve1b-async", 0, 110, ("python3", "benchmarks/serving.py", "--preset", "llama-1b", *SERVE,
                                   "--async-scheduling", "--api-server-count", "4")),
    Step("serve160m-async-1", 0, 60, ("python3", "benchmarks/serving.py", "--preset", "llama-160m", *SERVE,
                                      "--async-scheduling")),
    Step("serve-profile", 0, 300, ("python3", "benchmarks/serving_profile.py", "--device", "cuda", "--preset",
                                   "llama-160m", "--concurrency", "64", "--num-requests", "64",
                                   "--decode-steps", "64")),
)


def _json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _grep(path: Path, pattern: str) -> str | None:
    try:
        found = re.findall(pattern, path.read_text(errors="replace"))
    except OSError:
        return None
    return found[-1] if found else None


def figures(out: Path) -> list[tuple[str, str, str, str]]:
    """(figure, value, goal, met) from the steps' logs and JSON; a step that did not run says so."""
    rows: list[tuple[str, str, str, str]] = []

    def row(name: str, value: float | None, goal: float, fmt: str, at_most: bool = False) -> None:
        if value is None:
            rows.append((name, "not measured", f"{'<=' if at_most else '>='} {fmt.format(goal)}", "no"))
        else:
            met = value <= goal if at_most else value >= goal
            rows.append((name, fmt.format(value), f"{'<=' if at_most else '>='} {fmt.format(goal)}",
                         "yes" if met else "no"))

    tests = _grep(out / "tests.log", r"(\d+ passed[^\n]*)")
    failed = _grep(out / "tests.log", r"(\d+) failed")
    rows.append(("gpu tests", tests or "not run", "0 failed", "yes" if tests and not failed else "no"))
    bf16 = _json(out / "train1b-bf16.json")
    tessera = (bf16 or {}).get("results", {}).get("tessera", {})
    row("llama-1b bf16 MFU", tessera.get("mfu_bf16_peak"), 0.55, "{:.1%}")
    row("llama-1b vs transformers", (bf16 or {}).get("ratio"), 1.0, "{:.2f}x")
    fp8 = _json(out / "train1b-fp8.json")
    fp8_tok = (fp8 or {}).get("results", {}).get("tessera", {}).get("tokens_per_s")
    row("llama-1b fp8 / bf16", fp8_tok / tessera["tokens_per_s"] if fp8_tok and tessera else None, 1.15, "{:.2f}x")
    first = (fp8 or {}).get("results", {}).get("tessera", {}).get("first_step_s")
    row("fp8 first step (s)", first, 60.0, "{:.0f}", at_most=True)
    big = _json(out / "fp8-8b.json") or {}
    row("8B-shaped fp8 / bf16", big.get("speedup"), 1.3, "{:.2f}x")
    for step, goal in (("serve1b", 3.0), ("serve160m", 10.0)):
        ratio = _grep(out / f"{step}.log", r"TPOT median / physical floor: ([\d.]+)x")
        row(f"{step} TPOT / HBM floor", float(ratio) if ratio else None, goal, "{:.1f}x", at_most=True)
        # over 80% the client may be what set the TPOT (serving_client.py's warning line)
        busy = _grep(out / f"{step}.log", r"busiest process (\d+)% of its wall")
        row(f"{step} client busiest", int(busy) / 100 if busy else None, 0.8, "{:.0%}", at_most=True)
        # which server process bounds the TPOT (serving_client.describe_server): near 100%, that one
        server = _grep(out / f"{step}.log", r"busiest: ([\w -]+ \d+%)")
        rows.append((f"{step} server busiest", server or "not measured", "(which bounds)", "-"))
    return rows


def print_table(rows: list[tuple[str, str, str, str]]) -> None:
    print(f"{'figure':28}{'value':>22}{'goal':>12}  met")
    for name, value, goal, met in rows:
        print(f"{name:28}{value:>22}{goal:>12}  {met}")


def _normal(name: str) -> str:
    return re.sub(r"[-.]", "_", name).lower()


def _normal_spec(spec: str) -> str:
    name, _, version = spec.partition("==")
    return f"{_normal(name)}=={version}"


def check_plan(wheel_dir: Path) -> list[str]:
    """What is wrong with the plan, one line each: caps over budget, scripts or flags that do not
    exist, wheels missing."""
    problems = []
    total = sum(s.cap_s for s in PLAN)
    if total > BUDGET_S:
        problems.append(f"the caps add up to {total} s, over the {BUDGET_S} s budget")
    for part in sorted({s.part for s in PLAN}):
        used = sum(s.cap_s for s in PLAN if s.part == part)
        if used > CALL_LIMIT_S - CALL_MARGIN_S:
            problems.append(f"part {part}: its caps add up to {used} s, over one call's {CALL_LIMIT_S - CALL_MARGIN_S} s")
    for s in PLAN + EXTRAS:
        script = next((a for a in s.argv if a.endswith(".py")), None)
        if script is None:
            continue
        source = (ROOT / script).read_text() if (ROOT / script).is_file() else None
        if source is None:
            problems.append(f"{s.name}: {script} does not exist")
            continue
        for flag in (a for a in s.argv if a.startswith("--")):
            if f'"{flag}"' not in source:
                problems.append(f"{s.name}: {script} has no {flag} option")
    found = [w.name.split("-")[:2] for w in wheel_dir.glob("*.whl")]
    names = {_normal(name) for name, _ in found}
    pinned = {f"{_normal(name)}=={version}" for name, version in found}
    missing = [w for w in WHEELS if w not in names] + [w for w in TITAN_WHEELS if _normal_spec(w) not in pinned]
    if missing:
        problems.append(f"{wheel_dir}: no wheel for {', '.join(missing)} (fetch them: "
                        f"python3 benchmarks/gpu_session.py --fetch-wheels)")
    return problems


def fetch_wheels(wheel_dir: Path) -> int:
    """Each package as a cp312 wheel at the version installed here (the set the CPU suite tests),
    manylinux2014 first (torchao's pure wheel, which ran on the image); where the registry has none
    for that version, the newest it has, said in one line."""
    from importlib.metadata import PackageNotFoundError, version

    pip = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
           "3.12", "--implementation", "cp", "--platform", "manylinux2014_x86_64", "-d", str(wheel_dir)]
    newer = ["--platform", "manylinux_2_28_x86_64"]
    for spec in TITAN_WHEELS:  # pure Python, at the versions the peer was checked with
        if subprocess.run([*pip, "--platform", "any", spec]).returncode:
            return 1
    for name in (n.replace("_", "-") for n in WHEELS):
        try:
            spec = f"{name}=={version(name)}"
        except PackageNotFoundError:
            spec = name
        if any(subprocess.run([*pip, *extra, spec], capture_output=True).returncode == 0 for extra in ([], newer)):
            continue
        print(f"gpu_session: no cp312 wheel of {spec}; taking the newest {name} there is")
        if subprocess.run([*pip, *newer, name]).returncode:
            return 1
    return 0


def install(wheel_dir: Path) -> int:
    """The carried wheels, then Tessera's packages in editable mode; nothing when already there."""
    probe = "import tessera.inference, tessera.trainer, torchao, fastapi"
    if subprocess.run([sys.executable, "-c", probe], capture_output=True).returncode == 0:
        print("already installed (the machine is warm)")
        return 0
    wheels = sorted(str(w) for w in wheel_dir.glob("*.whl") if not w.name.startswith("torchtitan-"))
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
    if wheels and subprocess.run([*pip, "--upgrade", *wheels]).returncode:
        return 1
    for pkg in PACKAGES:
        if subprocess.run([*pip, "--no-build-isolation", "-e", str(ROOT / pkg)]).returncode:
            return 1
    return 0


def _release(wheel: Path) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", wheel.name.split("-")[1]))


def install_torchtitan(wheel_dir: Path) -> int:
    """The newest carried torchtitan whose trainer imports on this machine's torch (after --install
    put its dependencies in); one line for the one kept and one for each skipped, with the reason."""
    wheels = sorted(wheel_dir.glob("torchtitan-*.whl"), key=_release, reverse=True)
    if not wheels:
        print(f"gpu_session: no torchtitan wheel in {wheel_dir} (python3 benchmarks/gpu_session.py --fetch-wheels)")
        return 1
    probe = "import torch; print(torch.__version__, flush=True); import torchtitan.train"
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--force-reinstall"]
    skipped = []
    for wheel in wheels:
        release = wheel.name.split("-")[1]
        if subprocess.run([*pip, str(wheel)]).returncode:
            skipped.append(f"torchtitan {release}: pip could not install {wheel.name}")
            continue
        run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
        torch_version = run.stdout.strip() or "?"
        if run.returncode == 0:
            print(f"torchtitan {release}: its trainer imports on torch {torch_version}; installed")
            for line in skipped:
                print(f"  skipped {line}")
            return 0
        reason = (run.stderr.strip().splitlines() or [f"exit {run.returncode}"])[-1]
        skipped.append(f"torchtitan {release}: import torchtitan.train fails on torch {torch_version}: {reason}")
    print("gpu_session: no carried torchtitan imports here")
    for line in skipped:
        print(f"  {line}")
    return 1


def run_steps(steps: list[Step], out: Path) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("TRITON_INTERPRET", None)
    for s in steps:
        argv = [a.replace("{out}", str(out)) for a in s.argv]
        start = time.monotonic()
        with open(out / f"{s.name}.log", "w") as log:
            rc = subprocess.run(["timeout", str(s.cap_s), *argv], cwd=ROOT, env=env, stdout=log,
                                stderr=subprocess.STDOUT).returncode
        took = time.monotonic() - start
        status = "over its cap" if rc == 124 else f"exit {rc}"
        print(f"[gpu-session] {s.name}: {status} in {took:.0f} s (cap {s.cap_s} s)", flush=True)
    print_table(figures(out))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("part", nargs="?", type=int, choices=[1, 2], help="which device call to run")
    ap.add_argument("--dry-run", action="store_true", help="check the plan on CPU and print it")
    ap.add_argument("--install", action="store_true", help="install the wheels and Tessera (a plan step)")
    ap.add_argument("--install-torchtitan", action="store_true",
                    help="install the newest carried torchtitan that imports here (the titan step's first half)")
    ap.add_argument("--fetch-wheels", action="store_true", help="download the cp312 wheels into --wheels")
    ap.add_argument("--wheels", type=Path, default=ROOT / ".whl", help="the carried wheels' folder")
    ap.add_argument("--step", nargs="+", default=None, choices=[s.name for s in PLAN + EXTRAS],
                    help="run these steps by name instead of a part")
    ap.add_argument("--table", type=Path, default=None, help="print the table from a finished run's $OUT")
    args = ap.parse_args(argv)
    if args.install:
        return install(args.wheels)
    if args.install_torchtitan:
        return install_torchtitan(args.wheels)
    if args.fetch_wheels:
        return fetch_wheels(args.wheels)
    if args.table is not None:
        print_table(figures(args.table))
        return 0
    if args.dry_run:
        for s in PLAN:
            print(f"part {s.part}  {s.name:14}{s.cap_s:>5} s  {' '.join(s.argv)}")
        print(f"caps: {sum(s.cap_s for s in PLAN)} s of {BUDGET_S} s; " + ", ".join(
            f"part {p} {sum(s.cap_s for s in PLAN if s.part == p)} s" for p in sorted({s.part for s in PLAN})))
        problems = check_plan(args.wheels)
        for p in problems:
            print(f"gpu_session: {p}", file=sys.stderr)
        return 2 if problems else 0
    if args.part is None and not args.step:
        ap.error("name the part to run (1 or 2), the steps (--step), or --dry-run")
    out = Path(os.environ.get("OUT") or ROOT / "gpu-out")
    out.mkdir(parents=True, exist_ok=True)
    named = {s.name: s for s in PLAN + EXTRAS}
    run_steps([named[n] for n in args.step] if args.step else [s for s in PLAN if s.part == args.part], out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
