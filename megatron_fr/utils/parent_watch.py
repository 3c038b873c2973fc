"""Exit when the process that started this one is gone.

A launcher that is SIGKILLed cannot stop its children: torchrun runs each rank in a session of
its own, and the inference engine is started in its own session too. Each of them therefore
watches its parent and exits as soon as it has been re-parented, so killing a run's top
process stops the whole run and leaves nothing behind.
"""

from __future__ import annotations

import logging
import os
import threading
import time

log = logging.getLogger("megatron_fr.parent_watch")


def exit_when_parent_dies(parent_pid: int | None = None, interval_s: float = 0.5) -> None:
    """Start a daemon thread that ends this process (exit status 1) once parent_pid (default:
    the current parent) is no longer its parent."""
    parent = os.getppid() if parent_pid is None else parent_pid

    def watch() -> None:
        while True:
            time.sleep(interval_s)
            if os.getppid() != parent:
                log.warning("parent process %d is gone; exiting", parent)
                os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
