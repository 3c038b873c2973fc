"""Send bucket k while bucket k + 1 is being built: the stage sender's bucket loop.

    main thread:   build 1 | build 2          | build 3          | ...
    send thread:           | send 1           | send 2           | send 3 ...

Building a bucket (the shards' messages, the HF mapping) uses the learner's groups; sending
it uses the transport (its own weight-update group, HTTP). They overlap on two threads, and
the main thread alone runs the learner's collectives, so their order is the same on every
rank. Before handing bucket k + 1 over, the main thread waits until bucket k is sent: at most
one bucket is in flight and one being built, two buckets in memory.

A failed send is recorded and the buckets after it are dropped, but the loop goes on: the
sender's peers are waiting in the shard exchanges of the later buckets, and every rank must
reach the sync point where all of them learn of the failure together (sync._raise_if_any).
Each send is bounded by the transport's own deadlines (every engine call and broadcast has
timeout_s), so waiting for one ends; the thread is joined before the loop returns.

The current CUDA device is per thread and starts at 0 in a new one, so the send thread first
takes the device of the thread that created the sender (a stage's sending rank on GPU 3 would
otherwise run its NCCL broadcasts and copies on GPU 0).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from megatron_fr.weights.reshard import Bucket

SendAttempt = Callable[[Bucket], "str | None"]
"""Sends one bucket; returns a failure message (None if it was sent)."""

THREAD_NAME = "weight-sync-send"


class BucketSender:
    """Hands buckets to `send` one at a time, on a thread of its own when `overlap` (else in
    the caller's thread, the buckets one after the other). Use as a context manager: the
    thread is joined when the block ends."""

    def __init__(self, send: SendAttempt, overlap: bool = True):
        self._send = send
        self._executor = None
        if overlap:
            device = torch.cuda.current_device() if torch.cuda.is_available() else None
            self._executor = ThreadPoolExecutor(1, THREAD_NAME, _set_device, (device,))
        self._in_flight: Future | None = None
        self.failure: str | None = None

    def submit(self, bucket: Bucket) -> None:
        """Wait until the previous bucket is sent, then send this one (unless one failed)."""
        self._wait()
        if self.failure is not None:
            return
        if self._executor is None:
            self.failure = self._send(bucket)
        else:
            self._in_flight = self._executor.submit(self._send, bucket)

    def _wait(self) -> None:
        if self._in_flight is not None:
            future, self._in_flight = self._in_flight, None
            self.failure = future.result()  # an unexpected error is raised here, as in-line

    def finish(self) -> str | None:
        """Wait for the last bucket; the first failure, if any."""
        self._wait()
        return self.failure

    def __enter__(self) -> BucketSender:
        return self

    def __exit__(self, *exc_info: object) -> None:
        """Join the thread, also when the caller raised (the bucket in flight ends first)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)


def _set_device(device: int | None) -> None:
    """The send thread's first act: the creating thread's CUDA device (module docstring)."""
    if device is not None:
        torch.cuda.set_device(device)
