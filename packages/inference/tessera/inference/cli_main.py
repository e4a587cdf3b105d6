"""`python -m tessera.inference.cli_main ...` runs tessera-serve (for subprocess launchers)."""

from tessera.inference.cli import entry

if __name__ == "__main__":
    entry()
