"""Shared fixtures: small deterministic artifacts built in temporary directories."""

from __future__ import annotations

import os

import pytest
import torch

# Tests are sized for 2 cores; one thread per process keeps parallel workers from thrashing.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

# CPU engines serve eagerly in tests unless a test asks for compile (EngineConfig.cpu_compile): each
# compiled engine start takes tens of seconds (tessera.inference.config.CPU_COMPILE_ENV; set before any
# test starts a server or worker process, which inherit it).
os.environ.setdefault("TESSERA_CPU_COMPILE", "0")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
