"""Layers shared by model kinds: attention, mixture of experts, rotary embeddings."""
