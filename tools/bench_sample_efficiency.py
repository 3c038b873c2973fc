#!/usr/bin/env python
"""FlashREINFORCE vs GRPO vs RLOO at equal trained rollouts, and FlashREINFORCE's max_lag sweep.

    .venv/bin/python tools/bench_sample_efficiency.py methods examples/cpu_demo.yaml --out runs/cmp
    .venv/bin/python tools/bench_sample_efficiency.py lag examples/cpu_demo.yaml --out runs/lag

The same as `megatron-fr compare`; see megatron_fr/analysis/compare.py for what it runs.
"""

import argparse
import sys

from megatron_fr.analysis import compare

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    compare.add_arguments(parser)
    sys.exit(compare.run(parser.parse_args()))
