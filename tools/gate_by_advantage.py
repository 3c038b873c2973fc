#!/usr/bin/env python
"""Which trajectories the trust-region gate held out, by the sign of their advantage.

    .venv/bin/python tools/gate_by_advantage.py runs/lag/lag8-seed0 [--delta 3e-3]

See megatron_fr/analysis/gate_report.py.
"""

import sys

from megatron_fr.analysis import gate_report

if __name__ == "__main__":
    sys.exit(gate_report.main())
