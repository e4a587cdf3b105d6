"""The buffer tensor-parallel rank 0 shares with the driver for each step's logits rows
(worker/tensor_parallel/logits_mailbox.py), from another process as rank 0 writes it: rows come back exactly,
rows over its size are left to the pipe, a tmpfs without room is a fallback and not a crash,
and on a GPU the same holds over CUDA IPC."""

from __future__ import annotations

import errno
import json
import multiprocessing as mp
import os
import signal

import pytest
import torch

from tessera.inference.worker.tensor_parallel import logits_mailbox
from tessera.inference.worker.tensor_parallel.logits_mailbox import LogitsMailbox, open_mailbox, put_rows

CPU = torch.device("cpu")


def _rank0(spec: dict | None, tensor: torch.Tensor | None, seed: int, rows: int, world: int, conn) -> None:
    """What rank 0 does: vocabulary slices joined into the shared buffer; says whether they fit."""
    buffer, unmapped = open_mailbox(spec, tensor)
    assert unmapped is None
    g = torch.Generator().manual_seed(seed)
    slices = [torch.randn(rows, 8, generator=g) for _ in range(world)]
    device = buffer.device if buffer is not None else CPU
    written = put_rows(buffer, [s.to(device) for s in slices])
    conn.send(written is not None)
    conn.close()


def _round_trip(mailbox: LogitsMailbox, rows: int, world: int = 2, seed: int = 0) -> torch.Tensor | None:
    ours, theirs = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(target=_rank0, args=(mailbox.spec(), mailbox.tensor, seed, rows, world,
                                                                 theirs))
    proc.start()
    fitted = ours.recv()
    proc.join(60)
    assert proc.exitcode == 0
    if not fitted:
        return None
    return mailbox.take([rows, 8 * world], mailbox.device)


def _expected(seed: int, rows: int, world: int = 2) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.cat([torch.randn(rows, 8, generator=g) for _ in range(world)], dim=-1)


def test_rows_written_by_another_process_come_back_exactly_and_rows_over_the_size_are_refused():
    mailbox = LogitsMailbox(rows=4, vocab_rows=16, device=CPU)
    try:
        target = os.readlink(mailbox.path)  # the driver's descriptor: a tmpfs file with no name left
        assert target.endswith(" (deleted)")
        assert target.startswith(logits_mailbox.SHM_DIR) or not os.path.isdir(logits_mailbox.SHM_DIR)
        first = _round_trip(mailbox, rows=3, seed=1)
        assert torch.equal(first, _expected(1, 3))
        second = _round_trip(mailbox, rows=4, seed=2)  # the next step overwrites the buffer ...
        assert torch.equal(first, _expected(1, 3))  # ... not the rows the driver took
        assert torch.equal(second, _expected(2, 4))
        buffer, _ = open_mailbox(mailbox.spec(), None)
        assert put_rows(buffer, [torch.ones(5, 8)] * 2) is None  # 5 x 16 > 4 x 16: over the pipe
        assert torch.equal(mailbox.take([4, 16], CPU), second)  # and the buffer untouched
    finally:
        mailbox.release()
    buffer[:3] = 9  # released: the file goes with its last mapping, which both still share until then
    assert mailbox.path is None and torch.equal(mailbox.take([1, 3], CPU), torch.full((1, 3), 9.0))
    mailbox.release()  # twice: shutdown after a start that already released it


def _make_and_wait(shm_dir: str, conn) -> None:
    """A driver that makes the buffer, then is killed before any rank 0 reports ready."""
    logits_mailbox.SHM_DIR = shm_dir
    mailbox = LogitsMailbox(rows=4, vocab_rows=16, device=CPU)
    conn.send(mailbox.spec())
    conn.recv()  # never comes: SIGKILL


def test_a_driver_killed_before_rank_0_is_ready_leaves_no_file_behind(tmp_path):
    """The file has no name from the start (rank 0 opens it through the driver's descriptor): a driver
    killed while the workers load (minutes) would otherwise leave it in /dev/shm until a reboot."""
    ours, theirs = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(target=_make_and_wait, args=(str(tmp_path), theirs))
    proc.start()
    spec = ours.recv()
    buffer, unmapped = open_mailbox(spec, None)  # rank 0 maps it while the driver lives
    assert unmapped is None and buffer.numel() == 4 * 16
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(60)
    assert list(tmp_path.iterdir()) == []


def test_a_rank_0_that_cannot_open_the_file_says_why_instead_of_failing_the_start(tmp_path):
    buffer, unmapped = open_mailbox({"path": str(tmp_path / "gone"), "numel": 64, "vocab_rows": 16}, None)
    assert buffer is None and unmapped and "\n" not in unmapped
    assert list(tmp_path.iterdir()) == []  # not made afresh (a buffer the driver would never read)
    assert open_mailbox(None, None) == (None, None)  # no buffer asked for: nothing to say


def test_the_frames_read_are_the_ones_the_header_announces():
    """send_rows / receive_rows over a pipe: logits in the buffer or in a frame, pooled rows after them.
    A reply unlike the command (pooled rows nobody asked for, as the MTP's rows once came with the
    buffer passed as `pooled`) raises with the pipe still in step: the next header reads as one."""
    ours, theirs = mp.get_context("spawn").Pipe()
    mailbox = LogitsMailbox(rows=2, vocab_rows=8, device=CPU)
    try:
        buffer, _ = open_mailbox(mailbox.spec(), None)
        rows, pooled = torch.arange(16.0).view(2, 8), torch.full((1, 3), 0.5)
        wide = torch.arange(24.0).view(3, 8)  # over the buffer: a frame of its own
        for logits, fits in ((rows, True), (wide, False)):
            logits_mailbox.send_rows(theirs, [logits[:, :4], logits[:, 4:]], pooled=pooled, mailbox=buffer)
            head = json.loads(ours.recv_bytes())
            assert head["mailbox"] is fits
            got, got_pooled = logits_mailbox.receive_rows(head, ours, mailbox, CPU, pooling=True)
            assert torch.equal(got, logits) and torch.equal(got_pooled, pooled)
        logits_mailbox.send_rows(theirs, [rows], pooled=pooled, mailbox=buffer)
        theirs.send_bytes(b'{"t": "next"}')
        with pytest.raises(RuntimeError, match="with pooled rows"):
            logits_mailbox.receive_rows(json.loads(ours.recv_bytes()), ours, mailbox, CPU, pooling=False)
        assert json.loads(ours.recv_bytes()) == {"t": "next"}
        with pytest.raises(TypeError):  # the buffer cannot be passed where the pooled rows go
            logits_mailbox.send_rows(theirs, [rows], pooled, buffer)
    finally:
        mailbox.release()


def test_a_rank_0_gone_between_its_header_and_its_rows_ends_the_engine_as_a_dead_worker():
    """The driver reads a header announcing rows over the pipe, then the pipe closes: WorkerDied
    (which ends the engine and fails /health), not a bare EOFError from inside the step."""
    from tessera.inference.worker.tensor_parallel.executor import TensorParallelExecutor, WorkerDied

    ours, theirs = mp.get_context("spawn").Pipe()
    executor = object.__new__(TensorParallelExecutor)  # the driver's reading side only: no workers
    executor.conns, executor.procs, executor.mailbox, executor.unread = [ours], [], None, True
    theirs.send_bytes(json.dumps({"t": "logits", "shape": [2, 8], "mailbox": False}).encode())
    theirs.close()
    with pytest.raises(WorkerDied, match="worker 0 closed its pipe in the middle of a reply"):
        executor.recv_logits(CPU)


def test_a_shared_memory_without_room_leaves_the_rows_to_the_pipe_with_a_warning(monkeypatch, caplog):
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    before = set(os.listdir(logits_mailbox.SHM_DIR)) if os.path.isdir(logits_mailbox.SHM_DIR) else set()
    monkeypatch.setattr(os, "posix_fallocate", full)
    with caplog.at_level("WARNING", logger="tessera.inference"):
        assert LogitsMailbox.make(64, 1 << 20, CPU) is None
    assert "they go over the pipe" in caplog.text and "No space left" in caplog.text
    after = set(os.listdir(logits_mailbox.SHM_DIR)) if os.path.isdir(logits_mailbox.SHM_DIR) else set()
    assert after == before  # the file it began is removed


def test_the_buffer_is_capped_and_larger_steps_go_over_the_pipe(monkeypatch):
    monkeypatch.setattr(logits_mailbox, "MAX_BYTES", 1 << 20)  # (256 MiB: 523 rows of a 128k vocabulary)
    mailbox = LogitsMailbox(rows=4096, vocab_rows=128256, device=CPU)  # 2.1 GB asked for
    try:
        assert mailbox.rows == 2
        assert os.path.getsize(mailbox.path) == mailbox.numel * 4 <= logits_mailbox.MAX_BYTES
    finally:
        mailbox.release()


@pytest.mark.gpu
def test_over_cuda_ipc_rank_0_writes_on_the_device_and_the_driver_reads_the_rows():
    device = torch.device("cuda", 0)
    mailbox = LogitsMailbox(rows=4, vocab_rows=16, device=device)
    assert mailbox.path is None and mailbox.tensor is not None
    got = _round_trip(mailbox, rows=3, seed=5)
    assert got.device == device and torch.equal(got.cpu(), _expected(5, 3))
    assert _round_trip(mailbox, rows=5, seed=6) is None
