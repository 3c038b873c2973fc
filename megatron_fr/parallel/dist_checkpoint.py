"""megatron dist_checkpointing saves without a helper process per rank.

megatron's torch_dist writer collects its write results through
``multiprocessing.Manager().Queue()`` (dist_checkpointing/strategies/filesystem_async.py,
get_write_results_queue), which starts a Manager server process (a spawned interpreter of
~275 MB) on a rank's first save and keeps it for the life of the rank. A rank killed with
SIGKILL cannot stop it, so it lives on with parent 1: a preempted run leaves one per rank.
Our saves are synchronous (dist_checkpointing.save writes and reads the results back in the
calling process), for which a plain in-process queue does the same job with no process.
"""

from __future__ import annotations

import queue


def keep_writes_in_process() -> None:
    """Make megatron's save use an in-process results queue (idempotent; before a save)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()
