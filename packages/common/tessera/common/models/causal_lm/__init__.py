"""The causal language model: a decoder-only transformer trained on next-token prediction."""
