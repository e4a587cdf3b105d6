"""`python -m tessera.trainer` / `torchrun ... -m tessera.trainer`: the tessera-train CLI."""

from tessera.trainer.cli import entry

entry()
