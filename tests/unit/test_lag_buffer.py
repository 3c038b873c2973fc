"""LagAwareBuffer: random interleavings of admit / put / abandon / next_batch against a plain
model of the buffer, with the lag bound, capacity, admission formula and prompt accounting
checked after every step; plus checkpoint, thread and asyncio behaviour."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import threading
import time
from collections import Counter

import pydantic
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from megatron_fr.buffer.lag_buffer import BufferConfig, LagAwareBuffer, NotAdmittedError
from megatron_fr.buffer.trajectory import Trajectory


def make_trajectory(prompt_id: str, oldest: int, span: int = 0, reward: float = 1.0) -> Trajectory:
    """Prompt (2 tokens), a policy turn at `oldest`, a tool observation, a policy turn at
    oldest + span (a partial rollout that crossed `span` weight updates)."""
    return Trajectory(
        prompt_id=prompt_id,
        token_ids=[1, 2, 3, 4, 5, 6],
        action_mask=[False, False, True, True, False, True],
        behavior_log_probs=[0.0, 0.0, -0.5, -0.25, 0.0, -1.0],
        token_versions=[-1, -1, oldest, oldest, -1, oldest + span],
        reward=reward,
    )


# Each defect with the reason the buffer must count it under.
DEFECTS = [
    (lambda t: dataclasses.replace(t, reward=math.nan), "reward: not finite"),
    (
        lambda t: dataclasses.replace(t, behavior_log_probs=[0.0, 0.0, 0.5, -0.25, 0.0, -1.0]),
        "behavior_log_probs: positive under the action mask",
    ),
    (
        lambda t: dataclasses.replace(t, action_mask=t.action_mask[:-1]),
        "action_mask: length differs from token_ids",
    ),
    (
        lambda t: dataclasses.replace(t, token_versions=[-1, -1, -1, 0, -1, 0]),
        "token_versions: negative on a policy token",
    ),
]


ACTIONS = ("admit",) * 3 + ("put",) * 3 + ("learn",) * 2 + ("sync", "abandon", "readmit", "misuse")
"""The steps a random run picks from; repeats weigh the choice toward the busy path."""


@st.composite
def buffer_configs(draw) -> BufferConfig:
    batch_size = draw(st.integers(1, 4))
    max_lag = draw(st.integers(0, 3))
    # From "capacity binds before the staleness budget" to "it never does".
    capacity = draw(st.integers(batch_size, (max_lag + 2) * batch_size + 2))
    max_in_flight = draw(st.none() | st.integers(1, capacity))
    return BufferConfig(
        capacity=capacity, batch_size=batch_size, max_lag=max_lag, max_in_flight=max_in_flight
    )


class BufferMachine(RuleBasedStateMachine):
    """The model is a list-based re-statement of the documented semantics; the invariants
    read only the buffer's own outputs (batches, stats, state_dict, pop_requeued)."""

    @initialize(config=buffer_configs())
    def start(self, config: BufferConfig) -> None:
        self.config = config
        self.buffer = LagAwareBuffer(config)
        self.learner_version = 0  # = batches trained so far (one optimizer step per batch)
        self.buffer_version = 0  # what the buffer was last told
        self.fresh_ids = 0
        # model
        self.in_flight: list[str] = []
        self.queue: list[Trajectory] = []
        self.requeued: list[str] = []
        self.retired = 0
        self.reasons: Counter[str] = Counter()
        self.lags: Counter[int] = Counter()
        # what the buffer handed out, for the accounting invariant
        self.admitted: Counter[str] = Counter()
        self.trained: Counter[str] = Counter()
        self.popped: Counter[str] = Counter()

    # ---- model helpers ----

    def expect_admission(self) -> bool:
        c = self.config
        pending = len(self.in_flight) + len(self.queue)
        if pending >= c.capacity:
            return False
        if c.max_in_flight is not None and len(self.in_flight) >= c.max_in_flight:
            return False
        admitted_total = sum(self.admitted.values())
        # Versions start at 0 with one batch per version: AReaL's form of the budget.
        return (
            admitted_total + 1
            <= (self.buffer_version + c.max_lag + 1) * c.batch_size + self.retired
        )

    def model_retire(self, prompt_id: str) -> None:
        self.requeued.append(prompt_id)
        self.retired += 1

    def model_advance(self, version: int) -> None:
        if version > self.buffer_version:
            self.buffer_version = version
            keep = []
            for t in self.queue:
                if t.oldest_version < version - self.config.max_lag:
                    self.model_retire(t.prompt_id)
                else:
                    keep.append(t)
            self.queue = keep

    def try_admit(self, prompt_id: str) -> None:
        admitted = self.buffer.try_admit(prompt_id)
        assert admitted == self.expect_admission()
        if admitted:
            self.in_flight.append(prompt_id)
            self.admitted[prompt_id] += 1

    # ---- the one rule: a random step of the system ----

    @rule(action=st.sampled_from(ACTIONS), data=st.data())
    def step(self, action: str, data) -> None:
        getattr(self, action)(data)

    def admit(self, data) -> None:
        for _ in range(data.draw(st.integers(1, 6), label="admissions")):
            self.fresh_ids += 1
            self.try_admit(f"p{self.fresh_ids}")

    def readmit(self, data) -> None:
        popped = self.buffer.pop_requeued()
        assert popped == self.requeued  # FIFO, each once
        self.requeued = []
        self.popped.update(popped)
        for prompt_id in popped:
            if data.draw(st.booleans(), label=f"readmit {prompt_id}"):
                self.try_admit(prompt_id)

    def put(self, data) -> None:
        """Some rollouts finish, in any order: most valid (fresh or too old), some invalid."""
        if not self.in_flight:
            return
        finished = data.draw(st.permutations(self.in_flight), label="finish order")
        for prompt_id in finished[: data.draw(st.integers(1, len(finished)), label="finished")]:
            if data.draw(st.integers(0, 7), label="invalid if 7") == 7:
                self.put_invalid(prompt_id, data.draw(st.sampled_from(DEFECTS), label="defect"))
            else:
                self.put_valid(prompt_id, data)

    def put_valid(self, prompt_id: str, data) -> None:
        lowest = max(0, self.buffer_version - self.config.max_lag - 2)
        oldest = data.draw(st.integers(lowest, self.learner_version), label="oldest version")
        span = data.draw(st.integers(0, self.learner_version - oldest), label="span")
        trajectory = make_trajectory(prompt_id, oldest, span)
        outcome = self.buffer.put(trajectory)
        self.in_flight.remove(prompt_id)
        if oldest < self.buffer_version - self.config.max_lag:
            assert outcome == "dropped"
            self.model_retire(prompt_id)
        else:
            assert outcome == "queued"
            self.queue.append(trajectory)

    def put_invalid(self, prompt_id: str, defect) -> None:
        spoil, reason = defect
        assert self.buffer.put(spoil(make_trajectory(prompt_id, self.buffer_version))) == "rejected"
        self.in_flight.remove(prompt_id)
        self.model_retire(prompt_id)
        self.reasons[reason] += 1

    def abandon(self, data) -> None:
        if not self.in_flight:
            return
        prompt_id = data.draw(st.sampled_from(self.in_flight), label="abandoned")
        self.buffer.abandon(prompt_id)
        self.in_flight.remove(prompt_id)
        self.model_retire(prompt_id)

    def misuse(self, data) -> None:
        """put / abandon of a prompt with no rollout in flight: refused, nothing changes."""
        candidates = [t.prompt_id for t in self.queue] + [f"never{self.fresh_ids}"]
        prompt_id = data.draw(st.sampled_from(candidates), label="not in flight")
        before = self.buffer.stats()
        with pytest.raises(NotAdmittedError, match=repr(prompt_id)):
            self.buffer.put(make_trajectory(prompt_id, self.buffer_version))
        with pytest.raises(NotAdmittedError, match="has no rollout in flight"):
            self.buffer.abandon(prompt_id)
        assert self.buffer.stats() == before

    def learn(self, data) -> None:
        version = self.learner_version
        batch = self.buffer.next_batch(version)
        self.model_advance(version)
        size = self.config.batch_size
        if len(self.queue) < size:
            assert batch is None
            return
        expected, self.queue = self.queue[:size], self.queue[size:]
        assert batch == expected  # FIFO among fresh trajectories
        for t in batch:
            assert t.oldest_version >= version - self.config.max_lag, "lag bound broken"
            self.lags[version - t.oldest_version] += 1
        self.trained.update(t.prompt_id for t in batch)
        self.learner_version += 1

    def sync(self, data) -> None:
        """Weight sync done: rollouts now sample with the learner's version."""
        self.buffer.set_version(self.learner_version)
        self.model_advance(self.learner_version)

    # ---- invariants (after every step) ----

    @invariant()
    def bounds_hold(self) -> None:
        s = self.buffer.stats()
        c = self.config
        assert s["occupancy"] + s["in_flight"] <= c.capacity
        if c.max_in_flight is not None:
            assert s["in_flight"] <= c.max_in_flight
        retired = s["dropped_total"] + s["rejected_total"] + s["abandoned_total"]
        assert s["admitted_total"] <= (s["version"] + c.max_lag + 1) * c.batch_size + retired
        assert s["requeued_total"] == retired
        assert (s["occupancy"], s["in_flight"]) == (len(self.queue), len(self.in_flight))
        assert s["rejected_reasons"] == dict(self.reasons)
        assert s["lag_histogram"] == dict(self.lags)
        assert s["lag_max"] == (max(self.lags) if self.lags else None)
        assert all(0 <= lag <= c.max_lag for lag in s["lag_histogram"])

    @invariant()
    def every_admission_is_accounted_for_exactly_once(self) -> None:
        state = self.buffer.state_dict()
        where = (
            self.trained
            + self.popped
            + Counter(state["requeued"])
            + Counter(row["prompt_id"] for row in state["queued"])
            + Counter(state["in_flight"])
        )
        assert where == self.admitted
        s = self.buffer.stats()
        assert s["admitted_total"] == sum(self.admitted.values())
        assert s["consumed_total"] == sum(self.trained.values())


TestBufferMachine = BufferMachine.TestCase
TestBufferMachine.settings = settings(
    max_examples=100,
    stateful_step_count=60,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)


# ---- plain tests ---------------------------------------------------------------------------


def config(**overrides) -> BufferConfig:
    return BufferConfig(**{"capacity": 8, "batch_size": 2, "max_lag": 1, **overrides})


def test_config_refuses_what_cannot_work():
    with pytest.raises(pydantic.ValidationError, match=r"capacity \(1\) must be >= batch_size"):
        BufferConfig(capacity=1, batch_size=2)
    with pytest.raises(pydantic.ValidationError, match="max_lag"):
        BufferConfig(capacity=4, batch_size=2, max_lag=-1)
    with pytest.raises(pydantic.ValidationError, match="extra"):
        BufferConfig(capacity=4, batch_size=2, lag=1)
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        config().max_lag = 3


def test_admission_budget_worked_example():
    """B = 2, max_lag = 1: 4 pending at version 0; 2 once batch 0 is taken; 4 again at v1."""
    buffer = LagAwareBuffer(config())
    assert [buffer.try_admit(f"p{i}") for i in range(5)] == [True] * 4 + [False]
    for i in range(4):
        buffer.put(make_trajectory(f"p{i}", 0))
    assert [t.prompt_id for t in buffer.next_batch(0)] == ["p0", "p1"]
    assert not buffer.try_admit("p4")  # 2 queued for version 1's batch fill the budget
    buffer.set_version(1)
    assert buffer.try_admit("p4") and buffer.try_admit("p5") and not buffer.try_admit("p6")


def test_misuse_is_refused_with_the_prompt_named():
    buffer = LagAwareBuffer(config())
    assert buffer.try_admit("a")
    with pytest.raises(ValueError, match="'a' is already in flight"):
        buffer.try_admit("a")
    buffer.put(make_trajectory("a", 0))
    with pytest.raises(ValueError, match="'a' is already queued"):
        buffer.try_admit("a")
    with pytest.raises(NotAdmittedError, match="put: prompt_id 'a' has no rollout in flight"):
        buffer.put(make_trajectory("a", 0))
    with pytest.raises(ValueError, match="non-empty string"):
        buffer.try_admit("")
    buffer.set_version(3)
    with pytest.raises(ValueError, match="version 2 is older than the buffer's version 3"):
        buffer.next_batch(2)


def test_lag_statistics_of_consumed_trajectories():
    buffer = LagAwareBuffer(config(max_lag=2, capacity=6))
    for prompt_id, oldest in [("a", 0), ("b", 2), ("c", 1), ("d", 2)]:
        assert buffer.try_admit(prompt_id)
        buffer.put(make_trajectory(prompt_id, oldest, span=0))
    batch = buffer.next_batch(2)
    assert [t.prompt_id for t in batch] == ["a", "b"]  # a has lag 2: still fresh
    assert buffer.next_batch(3) is not None  # c (lag 2), d (lag 1)
    s = buffer.stats()
    assert s["lag_histogram"] == {0: 1, 1: 1, 2: 2}
    assert s["lag_mean"] == pytest.approx((2 + 0 + 2 + 1) / 4)
    assert s["lag_max"] == 2


def test_partial_rollout_is_as_old_as_its_oldest_token():
    buffer = LagAwareBuffer(config(max_lag=1))
    buffer.set_version(3)
    assert buffer.try_admit("a") and buffer.try_admit("b")
    assert buffer.put(make_trajectory("a", 1, span=2)) == "dropped"  # tokens at 1 and 3
    assert buffer.put(make_trajectory("b", 2, span=1)) == "queued"
    assert buffer.pop_requeued() == ["a"]


def test_state_dict_round_trip_requeues_the_rollouts_in_flight():
    cfg = config(capacity=8, max_lag=2)
    buffer = LagAwareBuffer(cfg)
    for prompt_id in ["a", "b", "c", "d", "e", "f"]:
        assert buffer.try_admit(prompt_id)
    buffer.put(make_trajectory("a", 0))
    buffer.put(make_trajectory("b", 0))
    assert buffer.next_batch(0) is not None
    buffer.put(make_trajectory("c", 0, reward=-2.0))
    buffer.put(dataclasses.replace(make_trajectory("d", 0), reward=math.inf))  # rejected
    buffer.abandon("e")  # "f" stays in flight

    state = json.loads(json.dumps(buffer.state_dict()))
    resumed = LagAwareBuffer(cfg)
    resumed.load_state_dict(state)

    old, new = buffer.stats(), resumed.stats()
    assert new["in_flight"] == 0 and new["occupancy"] == 1
    assert new["abandoned_total"] == old["abandoned_total"] + 1
    assert new["requeued_total"] == old["requeued_total"] + 1
    for key in ["version", "admitted_total", "consumed_total", "rejected_reasons", "lag_histogram"]:
        assert new[key] == old[key], key
    assert resumed.pop_requeued() == ["d", "e", "f"]
    assert resumed.state_dict()["queued"] == [make_trajectory("c", 0, reward=-2.0).to_dict()]
    # The budget carried over: version 0's batch is taken, 1 queued, so 4 - 1 more may start.
    assert [resumed.try_admit(f"n{i}") for i in range(4)] == [True] * 3 + [False]


def test_load_state_dict_refuses_a_used_buffer_and_re_checks_staleness():
    buffer = LagAwareBuffer(config(max_lag=3))
    buffer.set_version(3)
    for prompt_id, oldest in [("a", 0), ("b", 2)]:
        assert buffer.try_admit(prompt_id)
        buffer.put(make_trajectory(prompt_id, oldest))
    state = buffer.state_dict()
    with pytest.raises(RuntimeError, match="fresh buffer"):
        buffer.load_state_dict(state)
    stricter = LagAwareBuffer(config(max_lag=1))
    stricter.load_state_dict(state)
    assert stricter.pop_requeued() == ["a"]  # lag 3 > 1 under the new config
    assert stricter.stats()["occupancy"] == 1
    rows = [{**state["queued"][0], "prompt_id": f"q{i}"} for i in range(3)]
    with pytest.raises(ValueError, match="3 queued trajectories, more than capacity 2"):
        LagAwareBuffer(config(capacity=2)).load_state_dict({**state, "queued": rows})
    with pytest.raises(ValueError, match="queues the same prompt_id twice"):
        LagAwareBuffer(config()).load_state_dict({**state, "queued": state["queued"] * 2})


def test_producer_threads_and_a_consumer_account_for_every_prompt():
    cfg = BufferConfig(capacity=8, batch_size=4, max_lag=1)
    buffer = LagAwareBuffer(cfg)
    producers, per_producer = 3, 20
    errors: list[BaseException] = []

    def produce(worker: int) -> None:
        try:
            for i in range(per_producer):
                prompt_id = f"w{worker}-{i}"
                assert buffer.admit(prompt_id, timeout=10), f"{prompt_id} never admitted"
                version = buffer.stats()["version"]  # the weights this rollout samples with
                time.sleep(0.0005 * ((worker + i) % 3))
                if i % 7 == 3:
                    buffer.abandon(prompt_id)
                else:
                    buffer.put(make_trajectory(prompt_id, version))
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=produce, args=(w,)) for w in range(producers)]
    for thread in threads:
        thread.start()
    batches, version = [], 0
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        # Read before asking: a None after every producer finished means fewer than B are left.
        producers_done = not any(thread.is_alive() for thread in threads)
        batch = buffer.get_batch(version, timeout=0.05)
        if batch is not None:
            assert len(batch) == cfg.batch_size
            assert all(t.oldest_version >= version - cfg.max_lag for t in batch)
            batches.append(batch)
            version += 1
        elif producers_done:
            break
    for thread in threads:
        thread.join(timeout=5)
    assert not errors, errors
    trained = [t.prompt_id for batch in batches for t in batch]
    queued = [row["prompt_id"] for row in buffer.state_dict()["queued"]]
    everything = trained + buffer.pop_requeued() + queued
    assert sorted(everything) == sorted(
        f"w{w}-{i}" for w in range(producers) for i in range(per_producer)
    )
    s = buffer.stats()
    assert s["in_flight"] == 0 and s["occupancy"] == len(queued) < cfg.batch_size
    assert s["consumed_total"] == len(trained) and s["admitted_total"] == producers * per_producer
    assert s["abandoned_total"] == producers * 3  # i = 3, 10, 17


def test_async_get_batch_times_out_without_enough_fresh_data():
    async def scenario() -> None:
        buffer = LagAwareBuffer(config(max_lag=0))
        buffer.set_version(1)
        for prompt_id in ["fresh", "stale"]:
            assert buffer.try_admit(prompt_id)
        buffer.put(make_trajectory("fresh", 1))
        buffer.put(make_trajectory("stale", 0))
        start = time.monotonic()
        assert await buffer.get_batch_async(1, timeout=0.05) is None
        assert time.monotonic() - start >= 0.05
        assert buffer.pop_requeued() == ["stale"]
        assert buffer.stats()["occupancy"] == 1

    asyncio.run(scenario())


def test_async_waits_wake_on_changes_from_other_threads_without_blocking_the_loop():
    async def scenario() -> None:
        buffer = LagAwareBuffer(config(capacity=2, max_lag=0))
        assert buffer.try_admit("a") and buffer.try_admit("b")
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.005)

        ticking = asyncio.create_task(ticker())
        waiting = asyncio.create_task(buffer.admit_async("c", timeout=10))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        await asyncio.to_thread(buffer.abandon, "a")  # frees a slot from another thread
        assert await asyncio.wait_for(waiting, 2)

        getting = asyncio.create_task(buffer.get_batch_async(0, timeout=10))
        await asyncio.sleep(0.02)
        await asyncio.to_thread(buffer.put, make_trajectory("b", 0))
        await asyncio.to_thread(buffer.put, make_trajectory("c", 0))
        batch = await asyncio.wait_for(getting, 2)
        assert [t.prompt_id for t in batch] == ["b", "c"]
        ticking.cancel()
        assert ticks >= 10  # the loop kept running while both waited

    asyncio.run(scenario())


def test_cancelled_async_admission_admits_nothing():
    async def scenario() -> None:
        buffer = LagAwareBuffer(config(capacity=2))
        assert buffer.try_admit("a") and buffer.try_admit("b")
        waiting = asyncio.create_task(buffer.admit_async("c"))
        await asyncio.sleep(0.02)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        buffer.abandon("a")
        await asyncio.sleep(0.02)
        assert buffer.stats()["in_flight"] == 1
        assert buffer.try_admit("c")  # not admitted behind our back

    asyncio.run(scenario())
