"""`python -m megatron_fr ...` is the `megatron-fr` command."""

import sys

from megatron_fr.cli import main

sys.exit(main())
