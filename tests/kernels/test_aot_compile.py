"""The kernels compile for a real GPU (sm_90 cubin) even on a CPU-only machine.

The interpreter tests check what the kernels compute; this checks that the compiled path (what
runs on CUDA) builds, in a subprocess because Triton cannot be compiled and interpreted in one
process. See aot_compile.py; `python tests/kernels/aot_compile.py --all` checks every variant.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")


@pytest.mark.slow
def test_kernels_compile_for_sm90(tmp_path):
    pytest.importorskip("triton.backends.nvidia", reason="Triton without its NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # compile for real, not from an earlier run's cache
    script = Path(__file__).with_name("aot_compile.py")
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    compiled = [line for line in proc.stdout.splitlines() if line.startswith("ok sm_90")]
    names = {line.split()[2].split("[")[0] for line in compiled}
    assert names == {"_rms_norm_fwd_kernel", "_rms_norm_bwd_kernel", "_paged_attention_kernel",
                     "_combine_splits_kernel", "_rope_qk_kernel", "_swiglu_fwd_kernel", "_swiglu_bwd_kernel",
                     "_cross_entropy_grad_kernel"}, proc.stdout
