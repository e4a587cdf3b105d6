"""The trainer's parallel runtime: pipeline stages and schedules, data-parallel gradient buckets,
the distributed optimizer, launch flags.

Import the modules directly (`from tessera.trainer.parallel.runtime import ParallelRuntime`);
this file only makes the folder a regular package so the import contracts (pyproject.toml) see
its modules.
"""
