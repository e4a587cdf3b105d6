"""The Mamba-2 kernels (SSD scan forward/backward, causal conv1d, state updates) compile to sm_90
cubins on a CPU-only machine, as `aot_compile.py` does for the other kernels: the interpreter
tests check what they compute, this checks what the GPU would build (types, layouts, shared
memory). Run as a script (without TRITON_INTERPRET) for the variants; `--all` adds sm_80, fp16
and fp32 and the chunk sizes 128 and 64."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

FLOAT_SCALARS = {"dt_min", "dt_max"}


def _compile(fn, pointers: dict[str, str], constexprs: dict, cc: int, num_warps: int = 4) -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name] = pointers[name]
        else:
            signature[name] = "fp32" if name in FLOAT_SCALARS else "i32"
    kernel = triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget("cuda", cc, 32),
                            options={"num_warps": num_warps, "num_stages": 3})  # the launch default
    assert kernel.asm.get("cubin"), fn.__name__
    print(f"ok sm_{cc} {fn.__name__} shared={kernel.metadata.shared}B", flush=True)


def compile_all(dtype: str, cc: int, chunk: int, P: int = 64, N: int = 128) -> None:
    import torch
    import triton

    from tessera.kernels.ssm import conv_triton as conv
    from tessera.kernels.ssm import ssd_bwd_triton as bwd
    from tessera.kernels.ssm import ssd_fwd_triton as fwd
    from tessera.kernels.ssm import state_update_triton as su

    t = fwd.tiles(chunk, P, N, {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype])
    fp32 = dtype == "fp32"
    io = lambda *names: {n: f"*{dtype}" for n in names}  # noqa: E731
    f32 = lambda *names: {n: "*fp32" for n in names}  # noqa: E731
    seq = {"seq_ptr": "*i32"}
    flags = dict(P=P, N=N, L=chunk, HAS_SEQ=True, DOT_FP32=fp32)
    _compile(fwd._chunk_cumsum_kernel, io("dt_ptr") | f32("bias_ptr", "A_ptr", "dtp_ptr", "cs_ptr"),
             dict(L=chunk, HAS_BIAS=True, SOFTPLUS=True, HAS_LIMIT=True, BLOCK_L=triton.next_power_of_2(chunk),
                  BLOCK_H=16), cc)
    _compile(fwd._chunk_state_kernel, io("x_ptr", "B_ptr") | f32("dtp_ptr", "cs_ptr", "st_ptr") | seq,
             flags | dict(BLOCK_K=t["BLOCK_K"], BLOCK_P=t["BLOCK_P"], BLOCK_N=t["BLOCK_N"]), cc)
    _compile(fwd._state_passing_kernel, f32("st_ptr", "cs_ptr", "init_ptr", "sin_ptr", "final_ptr") | seq,
             dict(PN=P * N, L=chunk, HAS_INIT=True, HAS_SEQ=True, BLOCK=1024), cc)
    _compile(fwd._chunk_scan_fwd_kernel,
             io("x_ptr", "B_ptr", "C_ptr") | f32("dtp_ptr", "cs_ptr", "sin_ptr", "D_ptr", "y_ptr") | seq,
             flags | dict(HAS_D=True, **t), cc)
    _compile(bwd._bwd_dstates_kernel, io("C_ptr") | f32("dy_ptr", "cs_ptr", "dsl_ptr") | seq,
             flags | dict(BLOCK_K=t["BLOCK_K"], BLOCK_P=t["BLOCK_P"], BLOCK_N=t["BLOCK_N"]), cc)
    _compile(bwd._state_passing_bwd_kernel,
             f32("dsl_ptr", "sin_ptr", "cs_ptr", "dfinal_ptr", "dend_ptr", "ddecay_ptr", "dinit_ptr") | seq,
             dict(PN=P * N, L=chunk, HAS_DFINAL=True, HAS_SEQ=True, BLOCK=1024), cc)
    _compile(bwd._bwd_source_kernel,
             io("x_ptr", "B_ptr", "C_ptr", "dx_ptr") | seq
             | f32("dy_ptr", "dtp_ptr", "cs_ptr", "dend_ptr", "D_ptr", "ddt_ptr", "dB_ptr", "dcs_ptr", "dcs_state_ptr",
                   "dD_ptr"), flags | dict(HAS_D=True, **t), cc)
    _compile(bwd._bwd_target_kernel,
             io("x_ptr", "B_ptr", "C_ptr") | seq | f32("dy_ptr", "dtp_ptr", "cs_ptr", "sin_ptr", "dC_ptr", "dcs_ptr"),
             flags | t, cc)
    cflags = dict(K=4, HAS_SEQ=True, HAS_INIT=True, BLOCK_T=conv.BLOCK_T, BLOCK_C=conv.BLOCK_C)
    _compile(conv._conv_fwd_kernel, io("x_ptr", "w_ptr", "bias_ptr", "init_ptr", "y_ptr") | seq,
             cflags | dict(HAS_BIAS=True, SILU=True), cc)
    _compile(conv._conv_bwd_kernel, io("x_ptr", "w_ptr", "bias_ptr", "init_ptr", "dy_ptr") | seq
             | f32("dpre_ptr", "dw_ptr", "db_ptr"), cflags | dict(HAS_BIAS=True, SILU=True), cc)
    _compile(conv._conv_bwd_dx_kernel, io("w_ptr", "dx_ptr") | seq | f32("dpre_ptr", "dinit_ptr"), cflags, cc)
    _compile(conv._conv_update_kernel, io("x_ptr", "state_ptr", "w_ptr", "bias_ptr", "y_ptr") | {"idx_ptr": "*i32"},
             dict(K=4, HAS_IDX=True, HAS_BIAS=True, SILU=True, BLOCK_C=conv.BLOCK_C), cc, num_warps=2)
    _compile(su._state_update_kernel,
             io("x_ptr", "dt_ptr", "B_ptr", "C_ptr", "z_ptr") | {"idx_ptr": "*i32"}
             | f32("state_ptr", "bias_ptr", "A_ptr", "D_ptr", "y_ptr"),
             dict(HAS_IDX=True, HAS_BIAS=True, SOFTPLUS=True, HAS_LIMIT=True, HAS_D=True, HAS_Z=True,
                  BLOCK_P=min(P, 4096 // N), BLOCK_N=N), cc)


@pytest.mark.slow
def test_the_mamba_kernels_compile_for_sm90(tmp_path):
    pytest.importorskip("triton")
    pytest.importorskip("triton.backends.nvidia", reason="Triton without its NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    proc = subprocess.run([sys.executable, str(Path(__file__))], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sum(line.startswith("ok sm_90") for line in proc.stdout.splitlines()) == 13, proc.stdout


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("unset TRITON_INTERPRET (the kernels must be compiled, not interpreted)")
    if "--all" in sys.argv:
        for cc in (80, 90):
            for dtype in ("bf16", "fp16", "fp32"):
                for chunk in (256, 128, 64):
                    compile_all(dtype, cc, chunk)
    else:
        compile_all("bf16", 90, 256)
