"""tessera-train: parallel pretraining of GPT/Llama-family models from a mixture artifact."""
