"""Which problem the next rollout group works on: epochs over the training problems, re-queued
ones first. Owned by the LagAwareBuffer, which calls it under its lock.

Invariant (what resume relies on): within an epoch every problem is handed out once, in a
permutation fixed by (seed, epoch); a problem whose group never reached a batch (dropped as
too old, rejected, abandoned, or in flight when the run stopped) comes back through requeue()
and is handed out again before any new one. The cursor (epoch, index) and the re-queue are
the whole state, so a checkpoint of them, taken together with the buffer's, resumes without
using a problem twice before every problem has been used once.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Sequence


class PromptSource:
    def __init__(self, problem_ids: Sequence[str], seed: int):
        if not problem_ids:
            raise ValueError("no training problems")
        if len(set(problem_ids)) != len(problem_ids):
            raise ValueError("training problem ids are not unique")
        self.problem_ids = list(problem_ids)
        self.seed = seed
        self.epoch, self.index = 0, 0
        self._order = self._permutation(0)
        self._requeued: deque[str] = deque()

    def _permutation(self, epoch: int) -> list[str]:
        order = list(self.problem_ids)
        random.Random(f"{self.seed}:{epoch}").shuffle(order)
        return order

    def next(self) -> str:
        if self._requeued:
            return self._requeued.popleft()
        if self.index == len(self._order):
            self.epoch, self.index = self.epoch + 1, 0
            self._order = self._permutation(self.epoch)
        problem = self._order[self.index]
        self.index += 1
        return problem

    def requeue(self, problem_ids: Sequence[str]) -> None:
        """Hand these out again, after the ones already waiting."""
        self._requeued.extend(problem_ids)

    def requeue_first(self, problem_ids: Sequence[str]) -> None:
        """Hand these out again before anything else (in the order given)."""
        self._requeued.extendleft(reversed(problem_ids))

    @property
    def requeued_count(self) -> int:
        return len(self._requeued)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index, "requeued": list(self._requeued)}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
        self._order = self._permutation(self.epoch)
        self._requeued = deque(state["requeued"])
