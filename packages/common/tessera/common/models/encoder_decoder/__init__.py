"""The encoder-decoder kind (T5): config and model; not yet registered (see docs/model.md)."""
