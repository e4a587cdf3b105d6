"""Picking tokens: the sampler, structured output, speculative decoding."""
