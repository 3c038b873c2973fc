"""LagAwareBuffer: random interleavings of admit / put / abandon / next_batch / sync against a
plain model of the buffer (groups of G rollouts included), with the lag bound, capacity, the
admission formula, whole groups per batch and prompt accounting checked after every step;
plus checkpoint, close, thread and asyncio behaviour."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import threading
import time
from collections import Counter

import numpy as np
import pydantic
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from megatron_fr.buffer.lag_buffer import (
    Admission,
    BufferClosed,
    BufferConfig,
    LagAwareBuffer,
    NotAdmittedError,
)
from megatron_fr.buffer.prompts import PromptSource
from megatron_fr.buffer.trajectory import Trajectory
from megatron_fr.engine.routing import RoutedExperts

PROBLEMS = [f"q{i}" for i in range(7)]


def make_trajectory(prompt_id: str, oldest: int, span: int = 0, reward: float = 1.0) -> Trajectory:
    """Prompt (2 tokens), a policy turn at `oldest`, a tool observation, a policy turn at
    oldest + span (a partial rollout that crossed `span` weight updates); the routed experts
    of its 5 fed positions (2 layers, top-2 of 4 experts)."""
    return Trajectory(
        prompt_id=prompt_id,
        token_ids=[1, 2, 3, 4, 5, 6],
        action_mask=[False, False, True, True, False, True],
        behavior_log_probs=[0.0, 0.0, -0.5, -0.25, 0.0, -1.0],
        token_versions=[-1, -1, oldest, oldest, -1, oldest + span],
        reward=reward,
        routed_experts=RoutedExperts.compact([[[p % 4, (p + 1) % 4]] * 2 for p in range(5)], 4),
    )


def _routing(experts, num_experts: int = 4):
    return lambda t: dataclasses.replace(t, routed_experts=RoutedExperts(experts, num_experts))


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
    (
        _routing(np.array([[[0, 1]] * 2] * 6, np.uint8)),  # 6 positions for 6 tokens
        "routed_experts: positions differ from the tokens fed (length - 1)",
    ),
    (
        _routing(np.array([[0, 1]] * 5, np.uint8)),
        "routed_experts: is not [positions, layers, top_k]",
    ),
    (
        _routing(np.array([[[0, 1]] * 2] * 5, np.uint8), 1),
        "routed_experts: top_k is not in [1, num_experts]",
    ),
    (_routing(np.array([[[0, 4]] * 2] * 5, np.uint8)), "routed_experts: expert id out of range"),
]


def new_buffer(config: BufferConfig, problems=PROBLEMS, seed: int = 0) -> LagAwareBuffer:
    return LagAwareBuffer(config, PromptSource(problems, seed=seed))


ACTIONS = ("admit",) * 3 + ("put",) * 3 + ("learn",) * 2 + ("sync", "abandon", "misuse")
"""The steps a random run picks from; repeats weigh the choice toward the busy path."""


@st.composite
def buffer_configs(draw) -> BufferConfig:
    group_size = draw(st.integers(1, 3))
    batch_size = group_size * draw(st.integers(1, 3))
    max_lag = draw(st.integers(0, 3))
    # From "capacity binds before the staleness budget" to "it never does".
    fill = draw(st.booleans())
    smallest = (max_lag + 1) * batch_size if fill else batch_size
    capacity = draw(st.integers(smallest, (max_lag + 2) * batch_size + 2))
    max_in_flight = draw(st.none() | st.integers(group_size, capacity))
    return BufferConfig(
        capacity=capacity,
        batch_size=batch_size,
        group_size=group_size,
        max_lag=max_lag,
        max_in_flight=max_in_flight,
        fill_staleness_budget=fill,
        stale_policy=draw(st.sampled_from(["drop_trajectory", "mask_stale_tokens"])),
    )


def policy_versions(t: Trajectory) -> list[int]:
    return [int(v) for v, m in zip(t.token_versions, t.action_mask, strict=True) if m]


def age(config: BufferConfig, members: list[Trajectory]) -> int:
    """The documented rule: a trajectory is as old as its oldest policy token, or with
    mask_stale_tokens its newest; a group as its oldest member."""
    if config.stale_policy == "mask_stale_tokens":
        return min(max(policy_versions(t)) for t in members)
    return min(min(policy_versions(t)) for t in members)


class BufferMachine(RuleBasedStateMachine):
    """The model is a list-based re-statement of the documented semantics; the invariants
    read only the buffer's own outputs (admissions, batches, stats, state_dict)."""

    @initialize(config=buffer_configs())
    def start(self, config: BufferConfig) -> None:
        self.config = config
        self.buffer = new_buffer(config)
        self.learner_version = 0  # = batches trained so far (one optimizer step per batch)
        self.buffer_version = 0  # what the buffer was last told
        self.consumed_at_version = 0
        # model: groups by name -> (problem, members in flight, members done, failed)
        self.groups: dict[str, dict] = {}
        self.queue: list[list[Trajectory]] = []
        self.requeued: list[str] = []  # problems to hand out again, in order
        self.epoch_seen: set[str] = set()
        self.reasons: Counter[str] = Counter()
        self.lags: Counter[int] = Counter()
        self.masked = 0  # policy tokens made context (mask_stale_tokens)
        self.counts = Counter()
        # problem accounting: admissions per problem vs where each group ended
        self.admissions: Counter[str] = Counter()
        self.ended: Counter[str] = Counter()  # trained, or failed/dropped

    # ---- model helpers ----

    def in_flight(self) -> list[str]:
        return [p for g in self.groups.values() for p in g["in_flight"]]

    def expect_admission(self) -> bool:
        c, size = self.config, self.config.group_size
        live = sum(
            len(g["in_flight"]) + len(g["done"]) for g in self.groups.values() if not g["failed"]
        )
        held_or_in_flight = len(self.in_flight()) + sum(
            len(g["done"]) for g in self.groups.values()
        )
        queued = len(self.queue) * size
        if held_or_in_flight + queued + size > c.capacity:
            return False
        if c.max_in_flight is not None and len(self.in_flight()) + size > c.max_in_flight:
            return False
        budget = (c.max_lag + 1) * c.batch_size
        return live + queued + self.consumed_at_version + size <= budget

    def model_end_group(self, problem: str) -> None:
        self.requeued.append(problem)
        self.ended[problem] += 1

    def model_advance(self, version: int) -> None:
        if version > self.buffer_version:
            self.buffer_version, self.consumed_at_version = version, 0
            keep = []
            for members in self.queue:
                if age(self.config, members) < version - self.config.max_lag:
                    self.counts["dropped"] += len(members)
                    self.model_end_group(problem_of(members[0].prompt_id))
                else:
                    keep.append(members)
            self.queue = keep

    # ---- the one rule: a random step of the system ----

    @rule(action=st.sampled_from(ACTIONS), data=st.data())
    def step(self, action: str, data) -> None:
        getattr(self, action)(data)

    def admit(self, data) -> None:
        for _ in range(data.draw(st.integers(1, 4), label="admissions")):
            expected = self.expect_admission()
            admission = self.buffer.try_admit()
            assert (admission is not None) == expected
            if admission is None:
                continue
            if self.requeued:
                assert admission.problem == self.requeued.pop(0), "re-queued problems first"
            else:
                assert admission.problem not in self.epoch_seen, "a problem twice in an epoch"
                self.epoch_seen.add(admission.problem)
                if len(self.epoch_seen) == len(PROBLEMS):
                    self.epoch_seen = set()
            assert len(admission.prompt_ids) == self.config.group_size
            self.groups[admission.group] = dict(
                problem=admission.problem,
                in_flight=list(admission.prompt_ids),
                done=[],
                failed=False,
            )
            self.admissions[admission.problem] += 1
            self.counts["admitted"] += self.config.group_size

    def put(self, data) -> None:
        """Some rollouts finish, in any order: most valid (fresh or too old), some invalid."""
        in_flight = self.in_flight()
        if not in_flight:
            return
        finished = data.draw(st.permutations(in_flight), label="finish order")
        for prompt_id in finished[: data.draw(st.integers(1, len(finished)), label="finished")]:
            group = self.groups[group_of(prompt_id)]
            group["in_flight"].remove(prompt_id)
            if data.draw(st.integers(0, 9), label="invalid if 9") == 9:
                spoil, reason = data.draw(st.sampled_from(DEFECTS), label="defect")
                outcome = self.buffer.put(spoil(make_trajectory(prompt_id, self.buffer_version)))
                self.expect_failure(group, outcome, "rejected")
                if outcome == "rejected":
                    self.reasons[reason] += 1
            else:
                self.put_valid(prompt_id, group, data)
            self.forget_if_finished(prompt_id)

    def put_valid(self, prompt_id: str, group: dict, data) -> None:
        lowest = max(0, self.buffer_version - self.config.max_lag - 2)
        oldest = data.draw(st.integers(lowest, self.learner_version), label="oldest version")
        span = data.draw(st.integers(0, self.learner_version - oldest), label="span")
        trajectory = make_trajectory(prompt_id, oldest, span)
        outcome = self.buffer.put(trajectory)
        if group["failed"]:
            assert outcome == "discarded"
            self.counts["discarded"] += 1
            return
        group["done"].append(trajectory)
        if group["in_flight"]:
            assert outcome == "held"
            return
        members = sorted(group["done"], key=lambda t: t.prompt_id)
        group["done"] = []
        if age(self.config, members) < self.buffer_version - self.config.max_lag:
            assert outcome == "dropped"
            self.counts["dropped"] += len(members)
            self.model_end_group(group["problem"])
        else:
            assert outcome == "queued"
            self.queue.append(members)

    def expect_failure(self, group: dict, outcome: str, kind: str) -> None:
        if group["failed"]:
            assert outcome == ("discarded" if kind == "rejected" else None)
            self.counts["discarded" if kind == "rejected" else "abandoned"] += 1
            return
        assert outcome == ("rejected" if kind == "rejected" else None)
        self.counts[kind] += 1
        self.counts["discarded"] += len(group["done"])
        group["done"], group["failed"] = [], True
        self.model_end_group(group["problem"])

    def forget_if_finished(self, prompt_id: str) -> None:
        name = group_of(prompt_id)
        if not self.groups[name]["in_flight"] and not self.groups[name]["done"]:
            del self.groups[name]

    def abandon(self, data) -> None:
        in_flight = self.in_flight()
        if not in_flight:
            return
        prompt_id = data.draw(st.sampled_from(in_flight), label="abandoned")
        group = self.groups[group_of(prompt_id)]
        group["in_flight"].remove(prompt_id)
        self.expect_failure(group, self.buffer.abandon(prompt_id), "abandoned")
        self.forget_if_finished(prompt_id)

    def misuse(self, data) -> None:
        """put / abandon of a rollout with no slot in flight: refused, nothing changes."""
        candidates = [t.prompt_id for g in self.queue for t in g] + ["never@0#0"]
        prompt_id = data.draw(st.sampled_from(candidates), label="not in flight")
        before = self.buffer.stats()
        with pytest.raises(NotAdmittedError, match="has no rollout in flight"):
            self.buffer.put(make_trajectory(prompt_id, self.buffer_version))
        with pytest.raises(NotAdmittedError, match="has no rollout in flight"):
            self.buffer.abandon(prompt_id)
        assert self.buffer.stats() == before

    def learn(self, data) -> None:
        version = self.learner_version
        batch = self.buffer.next_batch(version)
        self.model_advance(version)
        groups = self.config.batch_size // self.config.group_size
        c = self.config
        unfilled = c.fill_staleness_budget and (
            len(self.queue) * c.group_size + self.consumed_at_version
            < (c.max_lag + 1) * c.batch_size
        )
        if len(self.queue) < groups or unfilled:
            assert batch is None
            return
        if c.fill_staleness_budget:  # the whole budget queued: in admission order
            self.queue.sort(
                key=lambda members: int(members[0].prompt_id.rsplit("@", 1)[1].split("#")[0])
            )
        expected, self.queue = self.queue[:groups], self.queue[groups:]
        taken = [t for members in expected for t in members]
        bound = version - self.config.max_lag
        if c.stale_policy == "drop_trajectory":
            assert batch == taken  # FIFO, whole groups
        else:  # the same rollouts, each policy token older than the bound made context
            assert [t.prompt_id for t in batch] == [t.prompt_id for t in taken]
            for trained, generated in zip(batch, taken, strict=True):
                kept = [v for v in policy_versions(generated) if v >= bound]
                assert policy_versions(trained) == kept
                assert np.array_equal(trained.token_ids, generated.token_ids)
                self.masked += len(policy_versions(generated)) - len(kept)
        for members in expected:
            self.ended[problem_of(members[0].prompt_id)] += 1
        for t in batch:
            assert min(policy_versions(t)) >= bound, "lag bound broken"
            self.lags[version - t.oldest_version] += 1
        self.counts["consumed"] += len(batch)
        self.consumed_at_version += len(batch)
        self.learner_version += 1

    def sync(self, data) -> None:
        """Weight sync done: rollouts now sample with the learner's version."""
        self.buffer.set_version(self.learner_version)
        self.model_advance(self.learner_version)

    # ---- invariants (after every step) ----

    @invariant()
    def bounds_and_counts_hold(self) -> None:
        s = self.buffer.stats()
        c = self.config
        assert s["occupancy"] + s["held"] + s["in_flight"] <= c.capacity
        if c.max_in_flight is not None:
            assert s["in_flight"] <= c.max_in_flight
        assert s["occupancy"] == len(self.queue) * c.group_size
        assert s["in_flight"] == len(self.in_flight())
        for name in ("admitted", "consumed", "dropped", "rejected", "abandoned", "discarded"):
            assert s[f"{name}_total"] == self.counts[name], name
        assert s["rejected_reasons"] == dict(self.reasons)
        assert s["stale_tokens_masked_total"] == self.masked
        assert s["lag_histogram"] == dict(self.lags)
        assert all(0 <= lag <= c.max_lag for lag in s["lag_histogram"])
        # every admitted rollout is in exactly one place
        retired = sum(s[f"{n}_total"] for n in ("dropped", "rejected", "abandoned", "discarded"))
        assert s["admitted_total"] == (
            s["consumed_total"] + retired + s["in_flight"] + s["held"] + s["occupancy"]
        )

    @invariant()
    def every_problem_handed_out_is_accounted_for(self) -> None:
        state = self.buffer.state_dict()
        assert state["source"]["requeued"] == self.requeued
        live = Counter(g["problem"] for g in self.groups.values() if not g["failed"])
        live += Counter(problem_of(members[0].prompt_id) for members in self.queue)
        assert self.admissions == self.ended + live


TestBufferMachine = BufferMachine.TestCase
TestBufferMachine.settings = settings(
    max_examples=100,
    stateful_step_count=60,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def group_of(prompt_id: str) -> str:
    return prompt_id.rsplit("#", 1)[0]


def problem_of(prompt_id: str) -> str:
    return group_of(prompt_id).rsplit("@", 1)[0]


# ---- plain tests ---------------------------------------------------------------------------


def config(**overrides) -> BufferConfig:
    return BufferConfig(**{"capacity": 8, "batch_size": 2, "max_lag": 1, **overrides})


def admit_all(buffer: LagAwareBuffer) -> list[Admission]:
    admissions = []
    while (admission := buffer.try_admit()) is not None:
        admissions.append(admission)
    return admissions


def test_config_refuses_what_cannot_work():
    with pytest.raises(pydantic.ValidationError, match=r"capacity \(1\) must be >= batch_size"):
        BufferConfig(capacity=1, batch_size=2)
    with pytest.raises(pydantic.ValidationError, match="multiple of group_size 3"):
        BufferConfig(capacity=8, batch_size=4, group_size=3)
    with pytest.raises(pydantic.ValidationError, match=r"max_in_flight \(2\) must be >= group"):
        BufferConfig(capacity=8, batch_size=4, group_size=4, max_in_flight=2)
    with pytest.raises(pydantic.ValidationError, match="max_lag"):
        BufferConfig(capacity=4, batch_size=2, max_lag=-1)
    with pytest.raises(pydantic.ValidationError, match="extra"):
        BufferConfig(capacity=4, batch_size=2, lag=1)
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        config().max_lag = 3
    with pytest.raises(pydantic.ValidationError, match=r"fill_staleness_budget needs capacity"):
        BufferConfig(capacity=6, batch_size=2, max_lag=3, fill_staleness_budget=True)


def test_filled_budget_trains_every_trajectory_exactly_max_lag_versions_old():
    """A generator slower than the learner: one rollout at a time, each finished with the
    weights it started with, the learner asking for a batch after each. Without
    fill_staleness_budget it trains on each batch as soon as it is ready (lag 0, whatever
    max_lag allows); with it the learner waits for the whole budget, (max_lag + 1) * B, so
    from step max_lag on every batch is exactly max_lag versions old."""
    max_lag = 3
    lags = {}
    for fill in (True, False):
        buffer = new_buffer(
            config(batch_size=2, max_lag=max_lag, capacity=8, fill_staleness_budget=fill)
        )
        lags[fill] = []
        for version in range(10):
            buffer.set_version(version)
            while (batch := buffer.next_batch(version)) is None:
                admission = buffer.try_admit()
                assert admission is not None, "the learner waits only while admission is open"
                buffer.put(make_trajectory(admission.prompt_ids[0], version))
            lags[fill].append({version - t.oldest_version for t in batch})
    assert lags[True] == [{0}, {1}, {2}] + [{max_lag}] * 7
    assert lags[False] == [{0}] * 10


def test_a_filled_budget_is_batched_in_admission_order_whatever_the_finishing_order():
    """With fill_staleness_budget the batch is the oldest-admitted groups, so which rollouts
    train together does not depend on which finished first (a seeded run is reproducible)."""
    buffer = new_buffer(config(batch_size=2, max_lag=1, capacity=4, fill_staleness_budget=True))
    admissions = admit_all(buffer)
    assert len(admissions) == 4
    for admission in reversed(admissions):  # the last admitted finishes first
        buffer.put(make_trajectory(admission.prompt_ids[0], 0))
    batch = buffer.next_batch(0)
    assert [t.prompt_id for t in batch] == [a.prompt_ids[0] for a in admissions[:2]]


def test_admission_budget_worked_example():
    """B = 2, max_lag = 1: 4 pending at version 0; 2 once batch 0 is taken; 4 again at v1."""
    buffer = new_buffer(config())
    admissions = admit_all(buffer)
    assert len(admissions) == 4
    for admission in admissions:
        buffer.put(make_trajectory(admission.prompt_ids[0], 0))
    batch = buffer.next_batch(0)
    assert [t.prompt_id for t in batch] == [a.prompt_ids[0] for a in admissions[:2]]
    assert buffer.try_admit() is None  # 2 queued for version 1's batch fill the budget
    buffer.set_version(1)
    assert len(admit_all(buffer)) == 2


def test_groups_are_admitted_together_and_batched_whole():
    buffer = new_buffer(config(batch_size=4, group_size=2, capacity=8, max_lag=0))
    first, second = admit_all(buffer)
    assert first.prompt_ids == (f"{first.group}#0", f"{first.group}#1")
    assert buffer.put(make_trajectory(second.prompt_ids[1], 0)) == "held"
    assert buffer.put(make_trajectory(first.prompt_ids[0], 0)) == "held"
    assert buffer.put(make_trajectory(first.prompt_ids[1], 0)) == "queued"
    assert buffer.next_batch(0) is None  # one group is half a batch
    assert buffer.put(make_trajectory(second.prompt_ids[0], 0)) == "queued"
    batch = buffer.next_batch(0)
    assert [t.prompt_id for t in batch] == [*first.prompt_ids, *second.prompt_ids]


def test_a_failed_member_discards_its_group_and_hands_the_problem_out_again():
    buffer = new_buffer(config(batch_size=3, group_size=3, capacity=9, max_lag=0))
    (group,) = admit_all(buffer)
    assert buffer.put(make_trajectory(group.prompt_ids[0], 0)) == "held"
    buffer.abandon(group.prompt_ids[1])  # the engine failed this rollout
    s = buffer.stats()
    assert (s["abandoned_total"], s["discarded_total"], s["groups_failed_total"]) == (1, 1, 1)
    assert buffer.put(make_trajectory(group.prompt_ids[2], 0)) == "discarded"
    # The failed group's rollouts are gone; the same problem comes back in a new group.
    again = buffer.try_admit()
    assert again.problem == group.problem and again.group != group.group
    rejected = dataclasses.replace(make_trajectory(again.prompt_ids[0], 0), reward=math.inf)
    assert buffer.put(rejected) == "rejected"
    assert buffer.stats()["rejected_reasons"] == {"reward: not finite": 1}


def test_bad_routing_is_rejected_on_entry_counted_by_reason_and_good_routing_kept():
    buffer = new_buffer(config(batch_size=1, max_lag=3))
    a, b, c = admit_all(buffer)[:3]
    for admission, (spoil, _) in zip((a, b), DEFECTS[-2:], strict=True):
        assert buffer.put(spoil(make_trajectory(admission.prompt_ids[0], 0))) == "rejected"
    assert buffer.stats()["rejected_total"] == 2
    assert buffer.stats()["rejected_reasons"] == {
        "routed_experts: top_k is not in [1, num_experts]": 1,
        "routed_experts: expert id out of range": 1,
    }
    good = make_trajectory(c.prompt_ids[0], 0)
    assert buffer.put(good) == "queued"
    state = json.loads(json.dumps(buffer.state_dict()))  # a checkpoint keeps the routing
    resumed = new_buffer(config(batch_size=1, max_lag=3))
    resumed.load_state_dict(state)
    assert resumed.next_batch(0) == [good]


def test_lag_statistics_of_consumed_trajectories():
    buffer = new_buffer(config(max_lag=2, capacity=6))
    admissions = admit_all(buffer)[:4]
    for admission, oldest in zip(admissions, [0, 2, 1, 2], strict=True):
        buffer.put(make_trajectory(admission.prompt_ids[0], oldest, span=0))
    buffer.set_version(2)
    assert len(buffer.next_batch(2)) == 2  # the first has lag 2: still fresh
    assert buffer.next_batch(3) is not None  # lag 2 and lag 1
    s = buffer.stats()
    assert s["lag_histogram"] == {0: 1, 1: 1, 2: 2}
    assert s["lag_mean"] == pytest.approx((2 + 0 + 2 + 1) / 4)
    assert s["lag_max"] == 2


def test_partial_rollout_is_as_old_as_its_oldest_token_and_a_group_as_its_oldest_member():
    buffer = new_buffer(config(max_lag=1, batch_size=2, group_size=2))
    buffer.set_version(3)
    a, b = admit_all(buffer)[:2]
    assert buffer.put(make_trajectory(a.prompt_ids[0], 1, span=2)) == "held"  # tokens at 1, 3
    assert buffer.put(make_trajectory(a.prompt_ids[1], 3)) == "dropped"
    assert buffer.put(make_trajectory(b.prompt_ids[0], 2, span=1)) == "held"
    assert buffer.put(make_trajectory(b.prompt_ids[1], 2)) == "queued"
    assert buffer.state_dict()["source"]["requeued"] == [a.problem]
    assert buffer.stats()["groups_dropped_total"] == 1


def test_state_dict_round_trip_re_issues_the_groups_that_never_reached_a_batch():
    cfg = config(capacity=8, max_lag=2)
    buffer = new_buffer(cfg)
    a, b, c, d, e, f = admit_all(buffer)
    buffer.put(make_trajectory(a.prompt_ids[0], 0))
    buffer.put(make_trajectory(b.prompt_ids[0], 0))
    assert buffer.next_batch(0) is not None
    buffer.put(make_trajectory(c.prompt_ids[0], 0, reward=-2.0))
    buffer.put(dataclasses.replace(make_trajectory(d.prompt_ids[0], 0), reward=math.inf))
    buffer.abandon(e.prompt_ids[0])  # f stays in flight

    state = json.loads(json.dumps(buffer.state_dict()))
    resumed = new_buffer(cfg)
    resumed.load_state_dict(state)

    old, new = buffer.stats(), resumed.stats()
    assert new["in_flight"] == 0 and new["occupancy"] == 1
    assert new["abandoned_total"] == old["abandoned_total"] + 1
    for key in ["version", "admitted_total", "consumed_total", "rejected_reasons", "lag_histogram"]:
        assert new[key] == old[key], key
    # the group in flight comes back first, then the failed ones in the order they failed
    assert resumed.state_dict()["source"]["requeued"] == [f.problem, d.problem, e.problem]
    assert resumed.state_dict()["queued"] == [
        [make_trajectory(c.prompt_ids[0], 0, reward=-2.0).to_dict()]
    ]
    # The budget carried over: version 0's batch is taken, 1 queued, so 4 - 1 more may start.
    again = admit_all(resumed)
    assert [g.problem for g in again] == [f.problem, d.problem, e.problem]
    assert len({g.group for g in again} | {a.group, b.group, c.group, d.group, e.group}) == 8


def test_load_state_dict_refuses_a_used_buffer_and_re_checks_staleness():
    buffer = new_buffer(config(max_lag=3))
    buffer.set_version(3)
    a, b = admit_all(buffer)[:2]
    buffer.put(make_trajectory(a.prompt_ids[0], 0))
    buffer.put(make_trajectory(b.prompt_ids[0], 2))
    state = buffer.state_dict()
    with pytest.raises(RuntimeError, match="fresh buffer"):
        buffer.load_state_dict(state)
    stricter = new_buffer(config(max_lag=1))
    stricter.load_state_dict(state)
    assert stricter.state_dict()["source"]["requeued"][-1] == a.problem  # lag 3 > 1 now
    assert stricter.stats()["occupancy"] == 1
    with pytest.raises(ValueError, match="4 queued trajectories, more than capacity 2"):
        new_buffer(config(capacity=2)).load_state_dict({**state, "queued": state["queued"] * 2})
    with pytest.raises(ValueError, match="groups of another size"):
        new_buffer(config(group_size=2)).load_state_dict(state)


def test_close_wakes_every_waiter_and_chains_the_cause():
    buffer = new_buffer(config(capacity=2, max_lag=0))
    admit_all(buffer)
    results: dict[str, object] = {}

    def wait_admission() -> None:
        results["admit"] = buffer.admit(timeout=30)

    def wait_batch() -> None:
        try:
            buffer.get_batch(0, timeout=30)
        except BufferClosed as error:
            results["batch"] = error

    threads = [threading.Thread(target=wait_admission), threading.Thread(target=wait_batch)]
    for thread in threads:
        thread.start()
    time.sleep(0.05)
    cause = RuntimeError("inference engine died")
    buffer.close(cause)
    for thread in threads:
        thread.join(timeout=5)
        assert not thread.is_alive()
    assert results["admit"] is None
    assert results["batch"].__cause__ is cause
    assert buffer.try_admit() is None


def test_producer_threads_and_a_consumer_account_for_every_rollout():
    cfg = BufferConfig(capacity=8, batch_size=4, group_size=2, max_lag=1)
    buffer = new_buffer(cfg, problems=[f"q{i}" for i in range(50)])
    producers, per_producer = 3, 10
    errors: list[BaseException] = []

    def produce(worker: int) -> None:
        try:
            for i in range(per_producer):
                admission = buffer.admit(timeout=10)
                assert admission is not None, "never admitted"
                version = buffer.stats()["version"]  # the weights these rollouts sample with
                time.sleep(0.0005 * ((worker + i) % 3))
                for k, prompt_id in enumerate(admission.prompt_ids):
                    if i % 7 == 3 and k == 1:
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
            assert Counter(group_of(t.prompt_id) for t in batch) == Counter(
                {group_of(batch[0].prompt_id): 2, group_of(batch[2].prompt_id): 2}
            )
            batches.append(batch)
            version += 1
        elif producers_done:
            break
    for thread in threads:
        thread.join(timeout=5)
    assert not errors, errors
    s = buffer.stats()
    assert s["in_flight"] == 0 and s["held"] == 0 and s["occupancy"] < cfg.batch_size
    assert s["admitted_total"] == producers * per_producer * 2
    assert s["abandoned_total"] == producers  # i = 3 in each worker
    retired = s["dropped_total"] + s["abandoned_total"] + s["discarded_total"]
    assert s["admitted_total"] == s["consumed_total"] + retired + s["occupancy"]


def test_async_get_batch_times_out_without_enough_fresh_data():
    async def scenario() -> None:
        buffer = new_buffer(config(max_lag=0))
        buffer.set_version(1)
        fresh, stale = admit_all(buffer)
        buffer.put(make_trajectory(fresh.prompt_ids[0], 1))
        assert buffer.put(make_trajectory(stale.prompt_ids[0], 0)) == "dropped"
        start = time.monotonic()
        assert await buffer.get_batch_async(1, timeout=0.05) is None
        assert time.monotonic() - start >= 0.05
        assert buffer.stats()["occupancy"] == 1

    asyncio.run(scenario())


def test_async_waits_wake_on_changes_from_other_threads_without_blocking_the_loop():
    async def scenario() -> None:
        buffer = new_buffer(config(capacity=2, max_lag=0))
        a, b = admit_all(buffer)
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.005)

        ticking = asyncio.create_task(ticker())
        waiting = asyncio.create_task(buffer.admit_async(timeout=10))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        await asyncio.to_thread(buffer.abandon, a.prompt_ids[0])  # frees a slot
        c = await asyncio.wait_for(waiting, 2)
        assert c.problem == a.problem  # the failed problem comes back first

        getting = asyncio.create_task(buffer.get_batch_async(0, timeout=10))
        await asyncio.sleep(0.02)
        await asyncio.to_thread(buffer.put, make_trajectory(b.prompt_ids[0], 0))
        await asyncio.to_thread(buffer.put, make_trajectory(c.prompt_ids[0], 0))
        batch = await asyncio.wait_for(getting, 2)
        assert [t.prompt_id for t in batch] == [b.prompt_ids[0], c.prompt_ids[0]]
        ticking.cancel()
        assert ticks >= 10  # the loop kept running while both waited

    asyncio.run(scenario())


def test_cancelled_async_admission_admits_nothing():
    async def scenario() -> None:
        buffer = new_buffer(config(capacity=2))
        a, _ = admit_all(buffer)
        waiting = asyncio.create_task(buffer.admit_async())
        await asyncio.sleep(0.02)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        buffer.abandon(a.prompt_ids[0])
        await asyncio.sleep(0.02)
        assert buffer.stats()["in_flight"] == 1
        assert buffer.try_admit() is not None  # not admitted behind our back

    asyncio.run(scenario())


def test_misuse_is_refused():
    buffer = new_buffer(config())
    (a, *_) = admit_all(buffer)
    buffer.put(make_trajectory(a.prompt_ids[0], 0))
    with pytest.raises(NotAdmittedError, match=r"put: prompt_id .* has no rollout in flight"):
        buffer.put(make_trajectory(a.prompt_ids[0], 0))
    buffer.set_version(3)
    with pytest.raises(ValueError, match="version 2 is older than the buffer's version 3"):
        buffer.next_batch(2)
