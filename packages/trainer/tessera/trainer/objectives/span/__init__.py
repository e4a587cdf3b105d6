"""Span corruption (T5's pretraining objective) for the encoder-decoder kind."""
