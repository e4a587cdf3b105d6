"""The scheduler and what it schedules: KV block manager, sequences (with their detokenizer and stop strings), sampling params."""
