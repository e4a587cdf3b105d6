"""The causal LM's Hugging Face architectures (GPT-2, Llama, Mistral, Qwen2/3, Mixtral, Qwen3-MoE) and its adapter."""
