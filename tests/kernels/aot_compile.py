"""Compile the Triton kernels ahead of time for a GPU target, on a machine without a GPU.

Triton's interpreter checks what the kernels compute but not that they compile: the real
compiler (type checks on loop-carried values, layouts, register and shared-memory budgets) only
runs for a GPU target. `triton.compile` with an explicit `GPUTarget` goes all the way to a cubin
with the ptxas bundled in the Triton wheel, no driver needed, so this script catches compile
errors in CI on CPU machines.

    python tests/kernels/aot_compile.py            # the variants `test_aot_compile` checks
    python tests/kernels/aot_compile.py --all      # every dtype and tile shape the wrappers pick

Must run without TRITON_INTERPRET (it needs compiled, not interpreted, kernels); prints one line
per kernel variant with its shared-memory use and exits 1 on the first failure.
"""

from __future__ import annotations

import argparse
import os
import sys

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("aot_compile.py: unset TRITON_INTERPRET (the kernels must be compiled, not interpreted)")

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from tessera.kernels import cross_entropy_triton as ce  # noqa: E402
from tessera.kernels import paged_attention_triton as pa  # noqa: E402
from tessera.kernels import rmsnorm_triton as rms  # noqa: E402
from tessera.kernels import rope_triton as rope  # noqa: E402
from tessera.kernels import swiglu_triton as swiglu  # noqa: E402

TRITON_DTYPE = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
FLOAT_SCALARS = {"eps", "qk_scale_log2"}


def compile_kernel(fn, pointers: dict[str, str], constexprs: dict, num_warps: int, cc: int,
                   num_stages: int = 3) -> None:
    """Compile `fn` with the given pointer element types; other arguments are i32 or fp32."""
    signature = {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name] = pointers[name]
        else:
            signature[name] = "fp32" if name in FLOAT_SCALARS else "i32"
    kernel = triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget("cuda", cc, 32),
                            options={"num_warps": num_warps, "num_stages": num_stages})
    assert kernel.asm.get("cubin"), f"{fn.__name__}: no cubin"
    shown = ", ".join(f"{k}={v}" for k, v in constexprs.items())
    print(f"ok sm_{cc} {fn.__name__}[{shown}] warps={num_warps} stages={num_stages} "
          f"shared={kernel.metadata.shared}B", flush=True)


def rmsnorm_variants(dtype: torch.dtype, hidden: int, cc: int) -> None:
    """Plain and fused-residual RMSNorm (the residual and the sum in `dtype` too)."""
    t = TRITON_DTYPE[dtype]
    block_n, num_warps = rms._launch_params(hidden)
    for residual in (False, True):
        compile_kernel(rms._rms_norm_fwd_kernel,
                       {"x_ptr": f"*{t}", "r_ptr": f"*{t}", "s_ptr": f"*{t}", "w_ptr": f"*{t}", "y_ptr": f"*{t}",
                        "rstd_ptr": "*fp32"},
                       {"HAS_RESIDUAL": residual, "BLOCK_N": block_n}, num_warps, cc)
        compile_kernel(rms._rms_norm_bwd_kernel,
                       {"x_ptr": f"*{t}", "w_ptr": f"*{t}", "dy_ptr": f"*{t}", "ds_ptr": f"*{t}", "rstd_ptr": "*fp32",
                        "dx_ptr": f"*{t}", "dw_partial_ptr": "*fp32"},
                       {"HAS_RESIDUAL": residual, "BLOCK_N": block_n}, num_warps, cc)


def elementwise_variants(dtype: torch.dtype, cc: int, q_heads: int = 32, kv_heads: int = 8,
                         head_dim: int = 128) -> None:
    """RoPE on q/k (forward and its transpose), SwiGLU forward/backward, cross-entropy's chunk step."""
    t = TRITON_DTYPE[dtype]
    for backward in (False, True):
        compile_kernel(rope._rope_qk_kernel,
                       {"q_ptr": f"*{t}", "k_ptr": f"*{t}", "cos_ptr": "*fp32", "sin_ptr": "*fp32",
                        "qo_ptr": f"*{t}", "ko_ptr": f"*{t}"},
                       {"BACKWARD": backward, "BLOCK_HQ": triton.next_power_of_2(q_heads),
                        "BLOCK_HK": triton.next_power_of_2(kv_heads), "BLOCK_HALF": head_dim // 2}, 4, cc)
    compile_kernel(swiglu._swiglu_fwd_kernel, {"g_ptr": f"*{t}", "u_ptr": f"*{t}", "h_ptr": f"*{t}"},
                   {"BLOCK": swiglu.BLOCK}, 4, cc)
    compile_kernel(swiglu._swiglu_bwd_kernel,
                   {name: f"*{t}" for name in ("dh_ptr", "g_ptr", "u_ptr", "dg_ptr", "du_ptr")},
                   {"BLOCK": swiglu.BLOCK}, 4, cc)
    compile_kernel(ce._cross_entropy_grad_kernel,
                   {"logits_ptr": f"*{t}", "labels_ptr": "*i64", "scale_ptr": "*fp32", "loss_ptr": "*fp32"},
                   {"BLOCK_V": 4096}, 8, cc)


def paged_variant(dtype: torch.dtype, decode: bool, group: int, head_dim: int, split: bool, cc: int) -> None:
    t = TRITON_DTYPE[dtype]
    tokens, seqs = (8, 8) if decode else (64, 2)
    block_m, block_q, block_n = pa._tile_shape(tokens, seqs, group, head_dim, dtype)
    block_d = max(16, triton.next_power_of_2(head_dim))
    pointers = {name: f"*{t}" for name in ("q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr")}
    pointers |= {name: "*i32" for name in ("block_tables_ptr", "seq_lens_ptr", "query_start_loc_ptr")}
    pointers |= {name: "*fp32" for name in ("part_acc_ptr", "part_m_ptr", "part_l_ptr")}
    constexprs = dict(GROUP=group, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
                      DOT_FP32=dtype == torch.float32, SPLIT_KV=split)
    num_warps, num_stages = pa._launch_config(dtype, block_m, head_dim)
    compile_kernel(pa._paged_attention_kernel, pointers, constexprs, num_warps, cc, num_stages)
    if split:
        compile_kernel(pa._combine_splits_kernel,
                       {"part_acc_ptr": "*fp32", "part_m_ptr": "*fp32", "part_l_ptr": "*fp32", "out_ptr": f"*{t}"},
                       {"BLOCK_S": 16, "BLOCK_D": block_d}, 1 if block_d <= 64 else 2, cc)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--all", action="store_true", help="every dtype, GQA ratio and head size, sm_80 and sm_90")
    parser.add_argument("--cc", type=int, default=90, help="compute capability for the quick set (default 90)")
    args = parser.parse_args(argv)
    if not args.all:
        rmsnorm_variants(torch.bfloat16, 4096, args.cc)
        elementwise_variants(torch.bfloat16, args.cc)
        paged_variant(torch.bfloat16, decode=True, group=4, head_dim=128, split=True, cc=args.cc)
        return 0
    for cc in (80, 90):
        for dtype in TRITON_DTYPE:
            rmsnorm_variants(dtype, 5120, cc)
            elementwise_variants(dtype, cc)
            elementwise_variants(dtype, cc, q_heads=12, kv_heads=12, head_dim=64)
            for decode, group, head_dim, split in [(True, 4, 128, False), (True, 4, 128, True), (False, 1, 128, False),
                                                   (False, 8, 256, False), (False, 7, 64, False)]:
                paged_variant(dtype, decode, group, head_dim, split, cc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
