"""How tensor-parallel rank 0 returns each step's logits rows to the driver (executor.py).

The driver samples, so every step it needs the gathered logits [R, vocab]: at 64 sequences and a
128k vocabulary that is 33 MB of fp32. Sent as bytes over the pipe they cost a device-to-host copy
on rank 0, a write and a read through the kernel, another copy on the driver and the copy back to
its device: milliseconds per step, more than a decode step of the model on a GPU. So both sides
share one float32 buffer instead, and the pipe carries only the header:

- CPU: a file in /dev/shm that both map (`torch.from_file(shared=True)`), reserved whole when made
  (`posix_fallocate`), so a full tmpfs is a start-up fallback to the pipe, never a SIGBUS mid-step.
  Its name is removed as soon as it is made: rank 0 opens it through the driver's descriptor
  (/proc/<driver>/fd/<fd>), which the driver closes once rank 0 has mapped it. A name kept until
  then would outlive a driver killed (SIGKILL, the OOM killer) while the workers load, as tmpfs
  memory nothing frees. A rank 0 that cannot open it (a locked-down /proc) leaves the rows to the pipe.
- CUDA: a tensor on the driver's device (cuda:0, rank 0's: loader.check_tensor_parallel refuses
  another) handed to rank 0 over CUDA IPC (torch.multiprocessing's reductions, in the spawn
  arguments only: the pipes stay JSON). Rank 0 writes into it on its device
  and synchronizes before it sends the header; the driver clones the rows and synchronizes before
  its next command, so rank 0 never overwrites rows the driver still reads.

Rank 0 writes `torch.cat(slices, out=rows)` straight into the buffer. A step with more rows than the
buffer holds (prompt logprobs over a long prompt) still goes over the pipe: the header says which, and
which frames follow it (the rows, if not in the buffer; then the pooled rows of embed requests).
The buffer holds `max_num_seqs x (1 + speculative tokens)` rows, every decode and verify step's, up
to MAX_BYTES (523 rows of a 128k vocabulary): memory the KV pool does not know of, on rank 0's GPU.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from multiprocessing.connection import Connection

import torch

log = logging.getLogger("tessera.inference")

SHM_DIR = "/dev/shm"
MAX_BYTES = 256 << 20


class LogitsMailbox:
    """The driver's side: made before the workers are spawned, `spec()` / `tensor` go to rank 0."""

    def __init__(self, rows: int, vocab_rows: int, device: torch.device):
        rows = max(1, min(rows, MAX_BYTES // (4 * vocab_rows)))
        self.rows, self.vocab_rows, self.device = rows, vocab_rows, device
        self.numel = rows * vocab_rows
        self.path: str | None = None  # CPU: where rank 0 opens the file, until `release`
        self._fd: int | None = None
        self.tensor: torch.Tensor | None = None  # CUDA: shared with rank 0 over CUDA IPC
        if device.type == "cuda":
            from torch import multiprocessing  # noqa: F401 - registers the CUDA IPC reductions spawn uses

            self.tensor = torch.empty(self.numel, dtype=torch.float32, device=device)
            self.buffer = self.tensor
            return
        fd, name = tempfile.mkstemp(prefix="tessera-logits-", dir=SHM_DIR if os.path.isdir(SHM_DIR) else None)
        try:
            os.unlink(name)  # nameless from the start: nothing to leave behind, however the driver ends
            os.posix_fallocate(fd, 0, self.numel * 4)
            self.path = f"/proc/{os.getpid()}/fd/{fd}"
            self.buffer = torch.from_file(self.path, shared=True, size=self.numel, dtype=torch.float32)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd

    @classmethod
    def make(cls, rows: int, vocab_rows: int, device: torch.device) -> LogitsMailbox | None:
        """The mailbox, or None (the pipe carries the rows) where shared memory cannot hold it."""
        try:
            return cls(rows, vocab_rows, device)
        except (OSError, RuntimeError) as exc:
            log.warning("tensor parallel: no shared buffer of %d x %d logits rows (%s); they go over the pipe",
                        rows, vocab_rows, exc)
            return None

    def spec(self) -> dict:
        """What rank 0's init message carries (JSON): the CPU file's path and size."""
        return {"path": self.path, "numel": self.numel, "vocab_rows": self.vocab_rows}

    def release(self) -> None:
        """Close the CPU file's descriptor (the mappings stay): once rank 0 has mapped it, and at shutdown."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd, self.path = None, None

    def take(self, shape: list[int], device: torch.device) -> torch.Tensor:
        """The rows rank 0 has just written, copied out (the buffer is rank 0's again at the next command)."""
        rows, width = shape
        out = self.buffer[:rows * width].view(rows, width).to(device, copy=True)
        if self.buffer.is_cuda:
            torch.cuda.current_stream(self.buffer.device).synchronize()
        return out


def open_mailbox(spec: dict | None, tensor: torch.Tensor | None) -> tuple[torch.Tensor | None, str | None]:
    """Rank 0's side: the shared buffer (flat float32), from the init message or the spawn arguments,
    and None or why the file could not be mapped (the driver then warns and uses the pipe)."""
    if tensor is not None:
        return tensor, None
    if spec is None or spec.get("path") is None:
        return None, None
    try:
        # from_file(shared=True) would make a missing file afresh, one the driver never reads: check first
        if (size := os.path.getsize(spec["path"])) != spec["numel"] * 4:
            raise OSError(f"{spec['path']} holds {size} bytes, not {spec['numel'] * 4}")
        return torch.from_file(spec["path"], shared=True, size=spec["numel"], dtype=torch.float32), None
    except (OSError, RuntimeError) as exc:
        return None, f"{type(exc).__name__}: {exc}".splitlines()[0]


def put_rows(buffer: torch.Tensor | None, slices: list[torch.Tensor]) -> torch.Tensor | None:
    """Write the vocabulary slices, joined, into the buffer; the rows as written there, or None
    when they do not fit (the caller sends them over the pipe)."""
    if buffer is None:
        return None
    rows, width = slices[0].shape[0], sum(s.shape[-1] for s in slices)
    if rows * width > buffer.numel() or rows == 0:
        return None
    out = buffer[:rows * width].view(rows, width)
    torch.cat([s.to(out.device) for s in slices], dim=-1, out=out)
    if out.is_cuda:
        torch.cuda.current_stream(out.device).synchronize()  # written before the header says so
    return out


def send_gathered(conn: Connection, local: torch.Tensor, rank: int, world: int, group, *,
                  pooled: torch.Tensor | None = None, mailbox: torch.Tensor | None = None) -> None:
    """Every rank: its vocabulary slice of the rows to rank 0, which returns them (`send_rows`)."""
    import torch.distributed as dist

    slices = [torch.empty_like(local) for _ in range(world)] if rank == 0 else None
    dist.gather(local.contiguous(), slices, dst=0, group=group)
    if rank == 0:
        assert slices is not None
        send_rows(conn, slices, pooled=pooled, mailbox=mailbox)


def send_rows(conn: Connection, slices: list[torch.Tensor], *, pooled: torch.Tensor | None = None,
              mailbox: torch.Tensor | None = None) -> None:
    """Rank 0: the logits rows (their vocabulary slices, joined here) into the shared buffer, or where
    they do not fit it, as raw fp32 bytes after the JSON header; then the pooled rows [E, d], if any.
    Keyword-only: both are tensors, and the buffer passed as `pooled` went over the pipe unasked."""
    written = put_rows(mailbox, slices)
    logits = written if written is not None else torch.cat(slices, dim=-1).cpu()
    head = {"t": "logits", "shape": list(logits.shape), "mailbox": written is not None}
    if pooled is not None:
        pooled = pooled.float().cpu()
        head["pooled"] = list(pooled.shape)
    conn.send_bytes(json.dumps(head).encode())
    if written is None:
        conn.send_bytes(logits.numpy().tobytes())
    if pooled is not None:  # one row per embed request, after the logits
        conn.send_bytes(pooled.numpy().tobytes())


def receive_rows(head: dict, conn: Connection, mailbox: LogitsMailbox | None, device: torch.device,
                 pooling: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The driver: the rows `head` (rank 0's header, read) announces, and the pooled rows with `pooling`.
    The frames read are the ones the header announces, so a reply unlike the command's raises here
    with the pipe still in step (a frame left unread would be taken for the next header)."""
    data = b"" if head.get("mailbox") else conn.recv_bytes()
    pooled = None
    if head.get("pooled") is not None:
        pooled = torch.frombuffer(bytearray(conn.recv_bytes()), dtype=torch.float32).view(*head["pooled"])
    if pooling != (pooled is not None):
        raise RuntimeError(f"tensor-parallel rank 0 replied {'without' if pooling else 'with'} pooled rows")
    if head.get("mailbox"):
        assert mailbox is not None
        return mailbox.take(head["shape"], device), pooled
    if not data:  # no row to sample this step (a prefill chunk short of its prompt's end): [0, vocab]
        return torch.empty(*head["shape"], device=device), pooled
    logits = torch.frombuffer(bytearray(data), dtype=torch.float32).view(*head["shape"])
    return logits.to(device), pooled
