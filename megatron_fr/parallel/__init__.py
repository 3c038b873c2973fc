"""Parallelism: megatron parallel_state, vocab-parallel log-probs, the parallel loss path.

Importing this package installs the import-time CPU shim megatron-core needs without triton
(cpu_shims.install_import_shims), so every module below may ``import megatron.core``.
"""

from megatron_fr.parallel.cpu_shims import install_import_shims

install_import_shims()
