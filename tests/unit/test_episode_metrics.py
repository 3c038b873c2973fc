"""A batch's episode figures (rollout/episodes.py episode_metrics): the tool-use ones are what
shows a policy giving up its tool, so each is checked against a count written out here."""

from __future__ import annotations

import pytest

from megatron_fr.buffer.trajectory import TrajectorySummary
from megatron_fr.rollout.episodes import episode_metrics


def summary(turns: int, *statuses_per_turn: list[str]) -> TrajectorySummary:
    steps = [{"tool_statuses": statuses} for statuses in statuses_per_turn]
    info = {"turns": turns, "steps": steps, "truncated": False}
    return TrajectorySummary("p", 1.0, 10, 5, 0, info)


def test_tool_use_rate_and_success_rate_count_trajectories_and_calls() -> None:
    batch = [
        summary(3, ["ok"], ["error", "ok"]),  # 3 calls, 1 failed
        summary(1),  # answered without the tool
        summary(2, ["timeout"]),  # 1 call, failed
        summary(1),
    ]
    figures = episode_metrics(batch)
    assert figures["tool_calls_mean"] == pytest.approx((3 + 0 + 1 + 0) / 4)
    assert figures["tool_errors_mean"] == pytest.approx((1 + 0 + 1 + 0) / 4)
    assert figures["tool_use_rate"] == pytest.approx(2 / 4)  # trajectories with >= 1 call
    assert figures["tool_success_rate"] == pytest.approx(2 / 4)  # calls that ran
    assert figures["turns_mean"] == pytest.approx(7 / 4)


def test_a_batch_without_a_call_has_no_success_rate_and_a_use_rate_of_zero() -> None:
    figures = episode_metrics([summary(1), summary(1)])
    assert figures["tool_use_rate"] == 0.0 and "tool_success_rate" not in figures


def test_single_turn_tasks_log_no_episode_figures() -> None:
    assert episode_metrics([TrajectorySummary("p", 0.0, 3, 2, 0, {})]) == {}
