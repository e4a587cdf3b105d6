"""What the megatron_*_save.py scripts share to run megatron-core on CPU: its CUDA calls stood in
for, and a gloo process group that needs no port when the script runs alone."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def init_cpu_process_group() -> None:
    """gloo under torchrun (its rendezvous), else one rank over an in-process store: a fixed
    MASTER_PORT could be taken by another test run on the same machine."""
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group("gloo", rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
