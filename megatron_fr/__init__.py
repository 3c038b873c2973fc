"""megatron-fr: FlashREINFORCE (critic-free, single-rollout, asynchronous RL) on Megatron-core.

Packages, with imports flowing one way (config is imported by everything, imports nothing):
  config/    typed configuration schemas (no torch, no megatron)
  algo/      advantages, FlashREINFORCE and baseline losses, rollout corrections (pure torch)
  parallel/  megatron parallel_state wrapper, vocab-parallel log-probs, the parallel loss path,
             the CPU compatibility shims for megatron-core
"""

__version__ = "0.1.0"
