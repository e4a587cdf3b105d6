"""Picking tokens: the sampler (and the verification of draft tokens), structured output."""
