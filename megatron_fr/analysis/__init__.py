"""Offline analysis of run directories: what a finished (or running) run left on disk, read
back into plots, tables and comparisons. Nothing here imports the run loop (orchestrator,
rollout, learner, weights, engines, models): it reads the files a run writes, and the
comparison starts its runs as `megatron-fr train` processes."""
