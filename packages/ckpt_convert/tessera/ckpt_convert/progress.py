"""Progress bars by bytes, with the tensor count alongside; `--quiet` turns them off."""

from __future__ import annotations

from tqdm import tqdm


class Progress:
    def __init__(self, total_bytes: int, total_tensors: int, desc: str, quiet: bool):
        self.bar = tqdm(total=total_bytes, unit="B", unit_scale=True, unit_divisor=1024, desc=desc,
                        disable=quiet, dynamic_ncols=True)
        self.total_tensors = total_tensors
        self.tensors = 0

    def update(self, nbytes: int, tensors: int = 1) -> None:
        self.tensors += tensors
        self.bar.set_postfix_str(f"{self.tensors}/{self.total_tensors} tensors", refresh=False)
        self.bar.update(nbytes)

    def close(self) -> None:
        self.bar.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
