"""tessera-ckpt: reshard, export to Hugging Face / TensorRT-LLM, import, verify and describe checkpoints."""
