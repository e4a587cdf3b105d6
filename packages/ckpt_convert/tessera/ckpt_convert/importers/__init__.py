"""What `tessera-ckpt import` reads: a Hugging Face directory (hf), a Megatron-Core torch_dist
checkpoint (megatron)."""
