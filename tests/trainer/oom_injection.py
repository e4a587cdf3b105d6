"""Out-of-memory errors injected into one phase of a training run, for test_out_of_memory (in process)
and as a torchrun worker (`oom_injection.py PHASE -- tessera-train args...`).

Each raises from step 2 on (step 1 completes and, with save_interval=1, is saved) in the component
that would really run out: a layer's forward, autograd's backward, AdamW's step, the checkpoint's
finalization, the engine's construction. Device errors carry torch's own CUDA message; the host one
is the CPU allocator's real error, from a real allocation larger than any machine's memory.
"""

from __future__ import annotations

import sys

import torch

CUDA_MESSAGE = ("CUDA out of memory. Tried to allocate 1.50 GiB. GPU 0 has a total capacity of 79.11 GiB of which "
                "512.00 MiB is free. Including non-PyTorch memory, this process has 78.59 GiB memory in use. Of the "
                "allocated memory 76.20 GiB is allocated by PyTorch, and 1.13 GiB is reserved by PyTorch but "
                "unallocated. If reserved but unallocated memory is large try setting "
                "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for "
                "Memory Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)")


def raise_device() -> None:
    raise torch.OutOfMemoryError(CUDA_MESSAGE)


def raise_host() -> None:
    torch.empty(2**46, dtype=torch.uint8)  # 64 TiB: the allocator refuses it (RuntimeError)
    raise AssertionError("a 64 TiB allocation succeeded")


def inject(patch, phase: str, raise_error=raise_device, from_step: int = 2) -> None:
    """`patch(owner, name, value)` (monkeypatch.setattr or setattr) the component of `phase`, to
    raise from step `from_step` on."""
    from tessera.common.layers.mlp import MLP
    from tessera.trainer import trainer as trainer_module
    from tessera.trainer.components.checkpoint import storage
    from tessera.trainer.trainer import Trainer

    started = [0]
    real_step = Trainer.train_step

    def train_step(self):
        started[0] += 1
        return real_step(self)

    patch(Trainer, "train_step", train_step)

    def from_step_2(real):
        def wrapper(*args, **kwargs):
            if started[0] >= from_step:
                raise_error()
            return real(*args, **kwargs)
        return wrapper

    if phase == "forward":
        patch(MLP, "forward", from_step_2(MLP.forward))
    elif phase == "backward":
        patch(torch.autograd, "backward", from_step_2(torch.autograd.backward))
    elif phase == "optimizer step":
        patch(torch.optim.AdamW, "step", from_step_2(torch.optim.AdamW.step))
    elif phase == "checkpoint save":
        patch(storage, "finalize_checkpoint", from_step_2(storage.finalize_checkpoint))
    elif phase == "setting up the model":
        started[0] = from_step
        patch(trainer_module, "build_engine", from_step_2(trainer_module.build_engine))
    else:
        raise ValueError(phase)


if __name__ == "__main__":  # torchrun worker: oom_injection.py PHASE -- ARGS
    from tessera.common.errors import run_cli
    from tessera.trainer.cli import main

    inject(setattr, sys.argv[1])
    run_cli(main, sys.argv[3:])
