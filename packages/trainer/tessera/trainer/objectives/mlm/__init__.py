"""The masked-LM objective (the encoder kind): BERT samples cut from sentence-split shards, masks
drawn from the seed and the sample number, and the MLM (+ binary head) loss."""
