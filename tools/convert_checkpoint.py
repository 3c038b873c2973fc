#!/usr/bin/env python
"""HF <-> megatron checkpoint conversion and logit verification (same as `megatron-fr convert`).

python tools/convert_checkpoint.py hf-to-megatron --hf-dir D --out O
python tools/convert_checkpoint.py megatron-to-hf --megatron-dir O --out D2
python tools/convert_checkpoint.py verify --hf-dir D --megatron-dir O --tp 2 --ep 2
"""

import sys

from megatron_fr.convert.cli import main
from megatron_fr.parallel.cpu_shims import install_cpu_shims

if __name__ == "__main__":
    install_cpu_shims()  # megatron without CUDA (a no-op with CUDA)
    sys.exit(main())
