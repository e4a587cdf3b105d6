"""Checkpointing a run: the checkpoint manager (`manager`), the stateful components it saves and
restores (`stateful`), and the crash-safe DCP files on disk (`storage`)."""
