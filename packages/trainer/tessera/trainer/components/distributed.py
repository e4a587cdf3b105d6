"""Joining the job: device choice and the default process group.

`tessera-train` run directly is one process with no process group. Under torchrun (WORLD_SIZE in
the environment) it joins a group: NCCL on GPUs, gloo on CPUs. The parallel layout's groups are
then built on it by tessera.common.parallel.state (tessera.trainer.parallel.engine); every
reduction (data-parallel gradients, losses) is the parallel runtime's.
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tessera.common.errors import UserError
from tessera.common.parallel.state import join_torchrun_job


@dataclass(frozen=True)
class Runtime:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def pick_device(requested: str, local_rank: int) -> torch.device:
    if requested == "cuda" and not torch.cuda.is_available():
        raise UserError("training.device=cuda but this torch has no usable CUDA device; use training.device=auto or cpu")
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def select_device(requested_device: str) -> torch.device:
    """This process's device (torchrun's LOCAL_RANK-th GPU), made current: before anything touches CUDA."""
    device = pick_device(requested_device, int(os.environ.get("LOCAL_RANK", "0")))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def init_runtime(requested_device: str) -> Runtime:
    """Join the torchrun process group when launched by torchrun; otherwise a single process."""
    if "WORLD_SIZE" not in os.environ:
        return Runtime(0, 1, 0, pick_device(requested_device, 0))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = select_device(requested_device)
    if not dist.is_initialized():
        join_torchrun_job("nccl" if device.type == "cuda" else "gloo")
    return Runtime(dist.get_rank(), dist.get_world_size(), local_rank, device)


def finish_runtime() -> None:
    """After a run every rank finished: drop unreferenced communication handles (cycles the pipeline
    schedule leaves) while their process groups live, then wait until every rank is here, so that
    no rank tears its groups down while a peer still uses them. A pipeline-parallel rank 0 was seen
    to abort at exit ("terminate called without an active exception") after a completed run; the
    cause is not pinned down, and this removes the two races it could come from."""
    if dist.is_initialized():
        gc.collect()
        dist.barrier()


def shutdown_runtime() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
