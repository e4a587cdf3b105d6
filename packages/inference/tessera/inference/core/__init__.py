"""The scheduler and what it schedules: KV block manager, sequences, sampling params."""
