"""Each model kind's training objective, one home per kind: what a batch holds (batches), the
one-process step with the kind's loss (step, loss), the objective the parallel runtime runs, and
the registry that finds them by the kind's hook names. The causal LM's next-token objective and
the document boundaries every kind's batches share sit at this level; mlm/ and span/ extend them."""
