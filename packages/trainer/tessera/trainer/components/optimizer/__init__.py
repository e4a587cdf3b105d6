"""The optimizer side of a step: AdamW and its parameter groups (optim), the learning-rate
schedule (schedule), gradient clipping (clip)."""
