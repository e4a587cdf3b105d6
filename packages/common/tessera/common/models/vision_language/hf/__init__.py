"""Hugging Face mapping of the vision-language kind (LlavaForConditionalGeneration)."""
