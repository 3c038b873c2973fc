"""The training loop's count of steps skipped for a non-finite loss or gradient: each skipped
step is flagged in its metrics and counted, a finite step resets the run of them, and the
limit in a row ends the run naming the cause and the setting."""

from __future__ import annotations

import pytest

from megatron_fr.orchestrator.controller import NonFiniteSteps, SkippedSteps


def test_skipped_steps_are_counted_and_the_limit_in_a_row_ends_the_run():
    skipped = SkippedSteps(limit=3, say=False)
    causes = [None, "gradient", "loss", None, "gradient", "gradient"]
    seen = []
    for step, cause in enumerate(causes, 1):
        metrics = {"nonfinite": cause}
        seen.append(
            (skipped.count(step, metrics), metrics["step_skipped"], metrics["skipped_steps_total"])
        )
    assert seen == [
        (False, 0.0, 0),
        (True, 1.0, 1),
        (True, 1.0, 2),
        (False, 0.0, 2),
        (True, 1.0, 3),
        (True, 1.0, 4),
    ]
    with pytest.raises(NonFiniteSteps) as ended:
        skipped.count(7, {"nonfinite": "gradient"})
    message = str(ended.value)
    assert "last 3 steps (to step 7) had a non-finite gradient" in message
    assert "learner.max_nonfinite_steps=3" in message
