"""Tensor-parallel serving: the driver's executor and model runner, the worker processes, and the
buffer the logits rows come back through."""
