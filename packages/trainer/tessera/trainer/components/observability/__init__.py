"""Watching a run: metrics and their sinks (`metrics`, `trackers`), profiler traces (`profiling`),
the hang watchdog (`watchdog`), stop signals (`signals`) and the host memory setting (`host_memory`)."""
