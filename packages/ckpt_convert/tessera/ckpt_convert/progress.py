"""Progress by bytes, with the tensor count alongside (a bar on a terminal, periodic lines in a log);
`--quiet` turns it off."""

from __future__ import annotations

from tessera.common.progress import progress


class Progress:
    def __init__(self, total_bytes: int, total_tensors: int, desc: str, quiet: bool):
        self.bar = progress(total=total_bytes, unit="B", unit_scale=True, desc=desc, quiet=quiet)
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
