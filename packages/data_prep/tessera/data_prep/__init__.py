"""tessera-data: read corpora, train or load a tokenizer, write, verify, inspect and blend shards."""
