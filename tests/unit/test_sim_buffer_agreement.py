"""The run simulator admits and drops exactly as the production buffer's rule says.

The simulator drives buffer/lag_buffer.py's LagAwareBuffer; these random runs check, after
every simulated event, that its own bookkeeping (rollouts on servers, held across a sync, in a
group being admitted; trajectories waiting for the learner; the batch taken at this version)
matches the buffer's, and that admission stopped exactly where the rule written out below
(from the buffer's docstring) closes it: the simulator neither under- nor over-admits.
"""

from __future__ import annotations

import pydantic
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_fr.buffer.lag_buffer import BufferConfig
from megatron_fr.sim.config import SimConfig
from megatron_fr.sim.engine import Scheme, Simulation
from megatron_fr.sim.lengths import RolloutLength


def admission_open(in_flight: int, held: int, consumed: int, config: BufferConfig) -> bool:
    """pending + consumed_at_version + G <= (max_lag + 1) * B, under capacity and
    max_in_flight, for a whole group of G (buffer/lag_buffer.py, _admission_open)."""
    size = config.group_size
    pending = in_flight + held
    if pending + size > config.capacity:
        return False
    if config.max_in_flight is not None and in_flight + size > config.max_in_flight:
        return False
    return pending + consumed + size <= (config.max_lag + 1) * config.batch_size


class Listed:
    def __init__(self, responses: list[int]) -> None:
        self.responses, self.index = responses, 0

    def draw(self) -> RolloutLength:
        self.index += 1
        return RolloutLength(3, self.responses[self.index % len(self.responses)])


class CheckedSimulation(Simulation):
    """Checks the invariants after every event handler."""

    checks = 0

    def _on_done(self, payload) -> None:
        super()._on_done(payload)
        self._check()

    def _on_trained(self, payload) -> None:
        super()._on_trained(payload)
        self._check()

    def _on_synced(self, payload) -> None:
        super()._on_synced(payload)
        if len(self.steps) < self.config.steps:  # the last sync admits nothing more
            self._check()

    def _check(self) -> None:
        config = self.scheme.buffer
        stats = self.buffer.stats()
        in_flight = self.in_flight
        held = len(self.requests) - in_flight  # finished, not yet trained or dropped
        consumed = 0 if self.learner_state == "waiting" else config.batch_size
        assert (stats["in_flight"], stats["occupancy"] + stats["held"]) == (in_flight, held)
        assert in_flight + held + consumed <= (config.max_lag + 1) * config.batch_size
        assert not admission_open(in_flight, held, consumed, config)
        for step in self.steps:
            assert max(step.lags) <= config.max_lag
        CheckedSimulation.checks += 1


@st.composite
def runs(draw):
    group = draw(st.sampled_from([1, 1, 2, 4]))
    batch = group * draw(st.integers(1, 4))
    max_lag = draw(st.integers(0, 3))
    capacity = draw(st.integers(batch, (max_lag + 2) * batch))
    max_in_flight = draw(st.one_of(st.none(), st.integers(group, 3 * batch)))
    buffer = BufferConfig(
        batch_size=batch,
        group_size=group,
        max_lag=max_lag,
        capacity=capacity,
        max_in_flight=max_in_flight,
    )
    config = SimConfig.model_validate(
        {
            "cluster": {"rollout_nodes": draw(st.integers(1, 3)), "gpus_per_node": 1},
            "server": {
                "gpus_per_server": 1,
                "single_stream_tokens_per_s": 10.0,
                "peak_tokens_per_s": draw(st.sampled_from([10.0, 40.0, 400.0])),
                "max_running_requests": draw(st.integers(1, 8)),
                "prefill_tokens_per_s": draw(st.sampled_from([None, 50.0])),
            },
            "learner": {"seconds_per_step": draw(st.floats(0.1, 5.0))},
            "sync": {"bytes": 0, "latency_s": draw(st.floats(0.0, 2.0))},
            "steps": 8,
            "warmup_steps": 0,
        }
    )
    responses = draw(st.lists(st.integers(1, 200), min_size=1, max_size=12))
    return config, Scheme("random", buffer), responses


@settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(runs())
def test_simulator_follows_the_buffer_rule(run):
    config, scheme, responses = run
    CheckedSimulation(config, scheme, Listed(responses)).run()
    assert CheckedSimulation.checks > 0


def test_group_larger_than_max_in_flight_is_refused_by_the_config():
    """A group is admitted whole, so max_in_flight < group size could never admit one: the
    run could not start. The buffer's config refuses it up front."""
    with pytest.raises(pydantic.ValidationError, match=r"max_in_flight \(2\) must be >= group"):
        BufferConfig(batch_size=4, group_size=4, max_lag=1, capacity=8, max_in_flight=2)
