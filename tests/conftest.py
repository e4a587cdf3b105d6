"""Shared fixtures: small deterministic artifacts built in temporary directories."""

from __future__ import annotations

import os

import pytest
import torch

# Tests are sized for 2 cores; one thread per process keeps parallel workers from thrashing.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
