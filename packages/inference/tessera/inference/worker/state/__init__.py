"""Per-sequence state for hybrid models: the state pool beside the paged KV cache, and the runner."""
