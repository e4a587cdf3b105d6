"""The encoder-decoder kind's Hugging Face adapter (T5ForConditionalGeneration)."""
