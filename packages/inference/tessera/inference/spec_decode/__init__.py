"""Speculative decoding: the proposers that draft tokens (a draft model runs on worker/'s runners) and their counts."""
