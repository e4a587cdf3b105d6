"""Serving multi-head latent attention (DeepSeek-V3): a latent KV cache and absorbed decode."""
