"""Executing a step: the model runner, its forward backends, loading and preparing models, the runner and cache of each model kind, pooling, CPU threads, tensor parallel."""
