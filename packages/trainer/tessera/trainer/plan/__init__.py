"""`tessera-plan`: per-rank memory, step time and MFU of a training run under a parallel layout,
predicted before any GPU is touched; and the layouts ranked for a GPU count (docs/parallelism.md)."""
