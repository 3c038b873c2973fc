"""PoolSync.wait, the learner's every wait on its leader (a batch, an evaluation): what it
decides between two looks, with the rollout process and the weight sync scripted. The real
run's version of each case is in tests/faults/test_engine_recovery.py."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import pytest

from megatron_fr.orchestrator.pool_sync import PoolSync, StopRequested


class ScriptedRollout:
    """The rollout process as the leader sees it: `answers` are what each look finds (None:
    nothing yet), `pool` the (epoch, joining) the pool is in at each look."""

    def __init__(self, answers: list[object], pool: list[tuple[int, list[str]]]) -> None:
        self.answers, self.pool, self.looks = answers, pool, 0

    def look(self) -> object:
        self.looks += 1
        return self.answers[self.looks - 1]

    def membership(self) -> tuple[int, list[str]]:
        return self.pool[self.looks - 1][0], ["http://e:1"]

    def joining(self) -> list[str]:
        return self.pool[self.looks - 1][1]


class LeaderAlone:
    """A one-rank world: share/act run the leader's part at once."""

    def __init__(self, rollout: ScriptedRollout, stop_at_look: int | None = None) -> None:
        self.rollout, self.stop_at_look = rollout, stop_at_look

    def stop_requested(self) -> bool:
        return self.rollout.looks == self.stop_at_look

    def share(self, ask: Callable[[LeaderAlone], object]) -> object:
        return ask(self)

    def act(self, work: Callable[[LeaderAlone], object]) -> None:
        work(self)


def waiting(rollout: ScriptedRollout, stop_at_look: int | None = None) -> tuple[PoolSync, list]:
    """A PoolSync over `rollout` whose weight sync records its versions instead of sending
    (and, as the real one does, remembers the epoch it synced)."""
    leader = LeaderAlone(rollout, stop_at_look)
    pool = PoolSync(None, SimpleNamespace(), leader)  # type: ignore[arg-type]
    synced: list[int] = []

    def sync(_model: object, version: int) -> float:
        synced.append(version)
        pool.seen = rollout.membership()[0]
        return 0.0

    pool.sync = sync  # type: ignore[method-assign]
    return pool, synced


def wait(pool: PoolSync, version: int) -> object:
    return pool.wait(lambda lead: lead.rollout.look(), model=None, version=version)  # type: ignore[arg-type]


def test_an_engine_that_joins_during_a_wait_gets_the_weights_before_the_wait_ends():
    # Look 1: nothing, the pool unchanged. Look 2: nothing, an engine restarted and joining
    # (epoch 3). Look 3: nothing, no change since. Look 4: the answer.
    pool_states = [(0, []), (3, ["u"]), (3, ["u"]), (3, [])]
    rollout = ScriptedRollout([None, None, None, "batch"], pool_states)
    pool, synced = waiting(rollout)
    assert wait(pool, 7) == "batch"
    assert synced == [7]  # once, at the version the learner is at
    assert rollout.looks == 4


def test_an_engine_that_left_is_not_worth_a_sync_while_waiting():
    rollout = ScriptedRollout([None, None, "evaluation"], [(0, []), (1, []), (1, [])])
    pool, synced = waiting(rollout)
    assert wait(pool, 2) == "evaluation"
    assert synced == []


def test_a_stop_request_ends_a_wait_that_would_never_end():
    rollout = ScriptedRollout([None, None, None], [(0, []), (0, []), (0, [])])
    pool, synced = waiting(rollout, stop_at_look=2)
    with pytest.raises(StopRequested) as stopped:
        wait(pool, 5)
    assert stopped.value.step == 5 and rollout.looks == 2 and synced == []


def test_an_answer_found_at_the_look_that_sees_the_stop_is_taken_first():
    rollout = ScriptedRollout(["batch"], [(0, [])])
    pool, _ = waiting(rollout, stop_at_look=1)
    assert wait(pool, 1) == "batch"
