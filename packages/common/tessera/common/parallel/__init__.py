"""Parallelism applied to the one model: process groups, tensor-parallel layers and their
communication, vocab-parallel loss, per-rank RNG streams, layout-free state dicts.

The layout type and its validator live in tessera.common.layout. Import the modules directly
(`from tessera.common.parallel.state import build_groups`); this file only makes the folder a
regular package so the import contracts (pyproject.toml) see its modules.
"""
