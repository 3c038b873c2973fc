#!/usr/bin/env python
"""Size a megatron-fr cluster run before launching it: a discrete-event simulation of rollout
servers, the lag-aware buffer and the learner (megatron_fr/sim/ has the model and formulas).

    python tools/simulate_run.py --nodes 4 8 16 32 64 --plot sweep.png
    python tools/simulate_run.py --suggest --nodes 16 --target-lag 8
    python tools/simulate_run.py --validate RUN_DIR
    python tools/simulate_run.py --help       # every setting, its default and meaning
"""

import sys

from megatron_fr.sim.cli import main

if __name__ == "__main__":
    sys.exit(main())
