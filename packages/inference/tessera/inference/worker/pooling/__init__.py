"""Pooling (embeddings): what a model directory declares (spec.py) and the runners that pool (runner.py, encoder.py)."""
