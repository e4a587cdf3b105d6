"""Serving an encoder-decoder (T5): its runner (runner.py) and its cache layout (cache.py)."""
