"""Parallelism: megatron parallel_state, vocab-parallel log-probs, the parallel loss path, the
rank-spawning helper and the CPU shims megatron needs without CUDA (installed by a program's
entry point, parallel/cpu_shims.py; importing this package has no side effect)."""
