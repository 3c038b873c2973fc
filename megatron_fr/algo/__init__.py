"""RL algorithms in pure torch (no megatron import): FlashREINFORCE, baselines, corrections."""
