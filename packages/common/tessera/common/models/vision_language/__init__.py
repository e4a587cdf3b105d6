"""Vision-language models: a ViT vision tower, the LLaVA projector and a causal LM."""
