"""Model kinds: one folder per kind (its model, config, Hugging Face adapters) and the registry the stages look kinds up in."""
