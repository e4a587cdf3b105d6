"""The small stateful components one trainer wires together: optimizer/, checkpoint/,
observability/, precision/, plus building the trainable model (model_setup) and joining the job
(distributed). Each takes its own config section and imports no objective, engine or loop."""
