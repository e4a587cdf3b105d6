"""The causal LM's Hugging Face architectures (GPT-2, Llama, Mistral, Qwen2/3, Mixtral, Qwen3-MoE)."""

# The shared package first: its __init__ re-exports this adapter (until the kind registry owns the dispatch).
import tessera.common.hf  # noqa: F401, E402
