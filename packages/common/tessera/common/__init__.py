"""Shared code of every Tessera stage: configs, the model, parallel layout, artifact formats."""

__version__ = "0.1.0"
