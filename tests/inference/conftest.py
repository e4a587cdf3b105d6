"""Fixtures for the inference tests; plain helpers live in inference_helpers.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from inference_helpers import make_checkpoint, tiny_config


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("run"), tiny_config())


