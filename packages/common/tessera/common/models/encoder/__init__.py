"""The encoder: BERT (bidirectional attention, masked-LM and binary heads), served as embeddings."""
