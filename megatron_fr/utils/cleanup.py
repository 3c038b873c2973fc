"""Closing the parts of a run: every part is closed whatever the others do, and the error that
ended the run is the one the run ends with.

A `finally` that closes parts one after the other loses both ways when a part fails to close:
the parts after it stay open (a rollout thread, the engines, the metric files), and its error
replaces the one that ended the run (a dead engine's weight-update group cannot be left, and
"no answer from /destroy_weights_update_group" would be what the user reads).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Sequence

log = logging.getLogger("megatron_fr.cleanup")


def close_in_order(parts: Sequence[tuple[str, Callable[[], object] | None]]) -> None:
    """Call each part's close (None: never built, skipped), in order. One that raises is
    logged naming the part, and the others still run. Called in a `finally` while an error
    propagates, it raises nothing, so that error ends the run as it is; otherwise it raises
    the first part's error once all have run."""
    failing = sys.exc_info()[1] is not None
    first: Exception | None = None
    for name, close in parts:
        if close is None:
            continue
        try:
            close()
        except Exception as error:
            log.error("closing the %s failed: %s", name, error)
            first = first or error
    if first is not None and not failing:
        raise first
