"""Numerics of the step: autocast and loss scaling (`mixed`), and float8 training behind one
backend interface (`float8`: torchao in `torchao_float8`, Transformer Engine in `te_float8`)."""
