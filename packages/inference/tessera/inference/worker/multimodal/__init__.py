"""Serving vision-language models: the runner that encodes a step's new images and writes their
features over the image tokens (runner.py)."""
