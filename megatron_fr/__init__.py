"""megatron-fr: FlashREINFORCE (critic-free, single-rollout, asynchronous RL) on Megatron-core
learners and SGLang inference servers.

The packages, top to bottom; a package imports only packages below it, and packages on one
line do not import each other (pyproject.toml [tool.importlinter], checked by the tests):

    cli                                   the `megatron-fr` command
    demo                                  the CPU demos' models (beside the production path)
    sim                                   the run simulator
    orchestrator                          the training loop, checks, checkpoints, metrics
    launch                                layout planner, memory rehearsal, Slurm renderer
    rollout | learner | weights           rollout service; megatron learner; weight sync
    envs | buffer | convert               environments; trajectories and the lag-aware buffer;
                                          HF <-> megatron conversion
    engine | models                       the inference engines' boundary (SGLang, vLLM, the
                                          CPU engine); models
    parallel                              parallel state, parallel losses, CPU shims
    algo                                  advantages and losses, pure torch
    config                                typed configuration (no torch)
    utils

Importing the package (or any of its modules) changes no environment variable: the entry
points that compute pin the CPU kernels themselves (megatron_fr/utils/cpu_kernels.py).
"""

__version__ = "0.1.0"
