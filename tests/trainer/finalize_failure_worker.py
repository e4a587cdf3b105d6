"""torchrun worker for test_async_save: rank 0 fails to finish a checkpoint; every rank must fail alike.

    torchrun --nproc-per-node 2 finalize_failure_worker.py ROOT TOKENIZER_DIR {sync|async}

Writes ROOT/../rank<R>.txt per rank: `rank R: <error>` (or `rank R: saved`); files, because the
ranks' printed lines can interleave on torchrun's shared stdout.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from tessera.common.checkpoint import CheckpointSidecar
from tessera.common.models.causal_lm.config import preset
from tessera.common.tokenizer import load_tokenizer
from tessera.trainer.components.checkpoint import storage
from tessera.trainer.components.checkpoint.storage import AsyncCheckpointer, TrainState, write_checkpoint


def main() -> None:
    root, tokenizer_dir, mode = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if rank == 0:
        def disk_full(*args, **kwargs):
            raise OSError("disk full (simulated)")
        storage.finalize_checkpoint = disk_full
    saver = AsyncCheckpointer() if mode == "async" else None
    sidecar = CheckpointSidecar(model=preset("tiny", vocab_size=384))
    state = {"model": {"w": torch.full((4,), float(rank))}} if rank == 0 else {"model": {}}
    try:
        write_checkpoint(root, state, TrainState(step=1), sidecar, load_tokenizer(tokenizer_dir), 2, saver)
        if saver is not None:
            saver.wait()
        outcome = f"rank {rank}: saved"
    except Exception as exc:
        outcome = f"rank {rank}: {exc}"
    (root.parent / f"rank{rank}.txt").write_text(outcome)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
