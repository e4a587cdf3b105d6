"""Executing a step: the model runner, its forward backends, loading and preparing models, tensor parallel."""
