"""The rehearsal's arguments checked before anything is built (launch/rehearse_cli.py), each
refused in one line naming the flag.

A rehearsal builds the rank's learner in a fake world of --world-size ranks, and megatron's
parallel state lists every rank of every group of that world: a world of 1,000,000,000 grew
the process to 20 GB before the kernel killed it, a skew of -5 or inf failed deep in the MoE
dispatcher, and `--check --rank 5` was silently taken although --check has no rank. So the
world is bounded (MAX_WORLD, past any cluster the planner is for) and checked against the
layout's divisibility first, the skew is a finite share within its range, and the flags that
only a rehearsal reads are refused without --rehearse.
"""

from __future__ import annotations

import argparse
import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatron_fr.config.run import RunConfig

MAX_WORLD = 1 << 16
"""The most learner ranks a layout is checked or rehearsed for (65,536 GPUs)."""
MAX_SKEW = 1024.0
"""(1 + skew) x the balanced tokens: past this many times every expert's share, the experts
of one rank would receive more tokens than a whole EP group of that size sends."""
REHEARSAL_ONLY = {
    "rank": "--rank",
    "stages": "--stages",
    "skew": "--skew",
    "cpu_kernels": "--cpu-kernels",
    "layers": "--layers",
}
"""The flags only --rehearse reads, by argparse destination."""
_UNSET = {"rank": None, "stages": False, "skew": 0.0, "cpu_kernels": False, "layers": 0}


def check_flags(args: argparse.Namespace) -> None:
    """ValueError naming the first flag given without a meaning in this mode, or out of its
    range (the world size's bound holds for --check as well)."""
    if args.world_size > MAX_WORLD:
        raise ValueError(f"--world-size {args.world_size}: at most {MAX_WORLD} learner ranks")
    if not getattr(args, "rehearse", False):
        for dest, flag in REHEARSAL_ONLY.items():
            if getattr(args, dest, _UNSET[dest]) != _UNSET[dest]:
                raise ValueError(f"{flag} applies to --rehearse only (give --rehearse, or drop it)")
        return
    skew = args.skew
    if not (math.isfinite(skew) and 0 <= skew <= MAX_SKEW):
        raise ValueError(f"--skew {skew}: must be a number from 0 to {MAX_SKEW:g}")
    if args.rank is not None and args.rank < 0:
        raise ValueError(f"--rank {args.rank}: ranks start at 0")
    if args.layers < 0:
        raise ValueError(f"--layers {args.layers}: a number of layers, at least 1")


def check_world(config: RunConfig, world: int, args: argparse.Namespace) -> None:
    """The world against the recipe's layout (megatron's divisibility rules) and --rank
    against the world, before the model is read or a rank is built."""
    if not 1 <= world <= MAX_WORLD:
        raise ValueError(f"world size {world}: must be 1 to {MAX_WORLD} learner ranks")
    try:
        config.parallel.validate_world(world)
    except ValueError as error:
        raise ValueError(
            f"--world-size {world} and the recipe's parallel layout: {error}"
        ) from None
    if args.rank is not None and not 0 <= args.rank < world:
        raise ValueError(f"--rank {args.rank}: the world has ranks 0 to {world - 1}")
