"""The hybrid kind's Hugging Face adapter (`adapter`) and its architectures, one module each."""
