"""Accelerators the planner knows: memory, dense bf16 FLOP/s, HBM and interconnect bandwidths.

Figures are the vendors' data sheets (SXM parts, dense, without sparsity); the bf16 peaks are the
trainer's own table (`tessera.trainer.components.observability.metrics.GPU_PEAK_TFLOPS`), so MFU means the same thing in
the planner and in the training log. `intra_node_gbps` is the per-GPU one-direction NVLink
bandwidth a collective inside a node sees (bus bandwidth), `inter_node_gbps` the per-GPU network
bandwidth (one 400 Gb/s NIC per GPU, as on DGX H100/H200 and most published clusters).

`cpu` describes this machine (memory from psutil; FLOP/s from an fp32 matmul and bandwidths from
a memory copy, measured when the plan is made, as the trainer's MFU on CPU measures its peak);
`custom` takes every figure from the command line.
"""

from __future__ import annotations

from pydantic import Field

from tessera.common.config import StrictModel
from tessera.common.errors import UserError
from tessera.trainer.components.observability.metrics import GPU_PEAK_TFLOPS

GIB = 2**30


class DeviceSpec(StrictModel):
    name: str = Field(..., description="What the figures describe.")
    memory_gib: float = Field(..., gt=0, description="Memory one rank may use (GiB).")
    peak_tflops: float = Field(..., gt=0, description="Dense bf16 (CPU: fp32) peak TFLOP/s of one device.")
    hbm_gbps: float = Field(..., gt=0, description="Memory bandwidth, GB/s.")
    intra_node_gbps: float = Field(..., gt=0, description="Per-device collective bandwidth inside a node, GB/s.")
    inter_node_gbps: float = Field(..., gt=0, description="Per-device network bandwidth between nodes, GB/s.")
    devices_per_node: int = Field(8, gt=0, description="Devices sharing the fast interconnect.")

    @property
    def memory_bytes(self) -> float:
        return self.memory_gib * GIB


DEVICES: dict[str, DeviceSpec] = {
    # H100 SXM5 80 GB: HBM3 3.35 TB/s, NVLink 4 900 GB/s bidirectional (450 one way), ConnectX-7 400 Gb/s.
    "h100": DeviceSpec(name="NVIDIA H100 SXM 80GB", memory_gib=80 * 1e9 / GIB, peak_tflops=GPU_PEAK_TFLOPS["H100 SXM"],
                       hbm_gbps=3350, intra_node_gbps=450, inter_node_gbps=50),
    # H200 SXM 141 GB: HBM3e 4.8 TB/s, same NVLink and compute as H100.
    "h200": DeviceSpec(name="NVIDIA H200 SXM 141GB", memory_gib=141 * 1e9 / GIB, peak_tflops=GPU_PEAK_TFLOPS["H200"],
                       hbm_gbps=4800, intra_node_gbps=450, inter_node_gbps=50),
    # A100 SXM4 80 GB: HBM2e 2.04 TB/s, NVLink 3 600 GB/s bidirectional, HDR 200 Gb/s.
    "a100": DeviceSpec(name="NVIDIA A100 SXM 80GB", memory_gib=80 * 1e9 / GIB, peak_tflops=GPU_PEAK_TFLOPS["A100"],
                       hbm_gbps=2039, intra_node_gbps=300, inter_node_gbps=25),
}


def measure_copy_gbps(mib: int = 64, repeats: int = 4) -> float:
    """Achieved GB/s of copying a tensor on this CPU (bytes read + written per second)."""
    import time

    import torch

    src = torch.ones(mib * 2**18)  # fp32
    dst = torch.empty_like(src)
    dst.copy_(src)  # touch the pages
    start = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    return 2 * src.nbytes * repeats / (time.perf_counter() - start) / 1e9


def cpu_device(memory_gib: float | None = None, peak_tflops: float | None = None) -> DeviceSpec:
    """This machine as a device: its memory (or `memory_gib`), a measured fp32 matmul peak, and a
    measured memory-copy bandwidth for memory and for collectives (gloo between ranks of one
    host moves bytes through shared memory: a copy bound)."""
    import psutil

    from tessera.trainer.components.observability.metrics import measure_matmul_tflops

    mem = memory_gib if memory_gib is not None else psutil.virtual_memory().total / GIB
    peak = peak_tflops if peak_tflops is not None else measure_matmul_tflops()
    copy = measure_copy_gbps()
    return DeviceSpec(name="this CPU (fp32 matmul measured)" if peak_tflops is None else "CPU",
                      memory_gib=mem, peak_tflops=peak, hbm_gbps=copy, intra_node_gbps=copy, inter_node_gbps=copy,
                      devices_per_node=1 << 16)


def resolve_device(kind: str, *, memory_gib: float | None = None, peak_tflops: float | None = None,
                   hbm_gbps: float | None = None, intra_node_gbps: float | None = None,
                   inter_node_gbps: float | None = None, devices_per_node: int | None = None) -> DeviceSpec:
    """A named device with any figure overridden, or `custom` (all of memory, FLOP/s and bandwidths given)."""
    given = {k: v for k, v in dict(memory_gib=memory_gib, peak_tflops=peak_tflops, hbm_gbps=hbm_gbps,
                                   intra_node_gbps=intra_node_gbps, inter_node_gbps=inter_node_gbps,
                                   devices_per_node=devices_per_node).items() if v is not None}
    if kind == "cpu":
        base = cpu_device(memory_gib, peak_tflops)
    elif kind == "custom":
        missing = [k for k in ("memory_gib", "peak_tflops", "hbm_gbps", "intra_node_gbps", "inter_node_gbps")
                   if k not in given]
        if missing:
            flags = ", ".join("--" + m.replace("_", "-") for m in missing)
            raise UserError(f"--device custom needs {flags}")
        return DeviceSpec(name="custom", **given)
    elif kind in DEVICES:
        base = DEVICES[kind]
    else:
        raise UserError(f"--device {kind!r}: choose one of {', '.join([*DEVICES, 'cpu', 'custom'])}")
    return base.model_copy(update=given) if given else base
