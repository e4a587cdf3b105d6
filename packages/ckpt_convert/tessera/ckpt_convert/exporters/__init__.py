"""What `tessera-ckpt export` writes: a Hugging Face directory (hf), a TensorRT-LLM checkpoint
(trtllm), a Megatron-Core torch_dist checkpoint (megatron)."""
