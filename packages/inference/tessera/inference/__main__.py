"""`python -m tessera.inference ...` runs tessera-serve (for subprocess launchers)."""

from tessera.inference.entrypoints.serve_cli import entry

if __name__ == "__main__":
    entry()
