"""Pooling models (embeddings): what a model directory declares (spec.py) and how the engine pools (runner.py)."""
