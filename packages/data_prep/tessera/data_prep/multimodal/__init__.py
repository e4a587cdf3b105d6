"""Image-text data: readers of LLaVA JSON, Parquet and WebDataset tars, and the image-text shard writer."""
