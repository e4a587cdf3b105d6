"""tessera.common.errors: running out of memory in any CLI is one line, exit 1, no traceback, with
what was asked and what was free (tessera-train adds where and what to change)."""

from __future__ import annotations

import errno

import pytest
import torch

from tessera.common.errors import describe_out_of_memory, out_of_memory, run_cli

CUDA = ("CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of 139.72 GiB of which "
        "4.06 MiB is free. Including non-PyTorch memory, this process has 139.70 GiB memory in use.")


def _host_allocation() -> None:
    torch.empty(2**46, dtype=torch.uint8)  # 64 TiB: the CPU allocator's real error


@pytest.mark.parametrize("raise_it, line", [
    (_host_allocation, "out of host memory: tried to allocate 65536.00 GiB, "),
    (lambda: (_ for _ in ()).throw(torch.OutOfMemoryError(CUDA)),
     "out of device memory: tried to allocate 20.00 MiB, 4.06 MiB free of 139.72 GiB"),
    (lambda: (_ for _ in ()).throw(OSError(errno.ENOMEM, "Cannot allocate memory")), "out of host memory"),
])
def test_a_cli_out_of_memory_is_one_line_exit_1(capsys, raise_it, line):
    def main(argv):
        try:
            raise_it()
        except BaseException as exc:  # wrapped, as DCP and others wrap it: found inside
            raise ValueError("while writing") from exc

    with pytest.raises(SystemExit) as exc:
        run_cli(main, [])
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 1 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert line in err, err


def test_other_errors_are_not_taken_for_memory():
    assert out_of_memory(RuntimeError("shape mismatch: tried to allocate nothing")) is None
    assert out_of_memory(ValueError("DefaultCPUAllocator")) is None
    assert out_of_memory(OSError(errno.ENOSPC, "No space left on device")) is None
    assert describe_out_of_memory(torch.OutOfMemoryError("CUDA out of memory.")) == "out of device memory"
