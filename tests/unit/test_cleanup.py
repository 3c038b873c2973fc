"""close_in_order, the end of a run's cleanup: every part is closed whatever the others do,
and a failure while closing never hides the error that ended the run."""

from __future__ import annotations

import logging

import pytest

from megatron_fr.utils.cleanup import close_in_order


class Part:
    def __init__(self, name: str, calls: list[str], error: Exception | None = None) -> None:
        self.name, self.calls, self.error = name, calls, error

    def close(self) -> None:
        self.calls.append(self.name)
        if self.error is not None:
            raise self.error


def parts(calls: list[str]) -> list[tuple[str, object]]:
    failing_sync = Part(
        "weight sync", calls, RuntimeError("/destroy_weights_update_group: no answer")
    )
    failing_service = Part("rollout service", calls, RuntimeError("thread did not stop"))
    return [(p.name, p.close) for p in (failing_sync, failing_service, Part("report", calls))]


def test_the_error_that_ended_the_run_is_the_one_raised_and_every_part_is_closed(caplog):
    calls: list[str] = []
    caplog.set_level(logging.ERROR, logger="megatron_fr.cleanup")
    with pytest.raises(ValueError, match="engine http://e:1 exited") as raised:
        try:
            raise ValueError("inference engine http://e:1 exited with code -9")
        finally:
            close_in_order(parts(calls))
    assert raised.value.__context__ is None  # nothing of the cleanup chained onto the cause
    assert calls == ["weight sync", "rollout service", "report"]
    logged = [record.getMessage() for record in caplog.records]
    assert any("weight sync" in line and "destroy_weights_update_group" in line for line in logged)
    assert any("rollout service" in line and "did not stop" in line for line in logged)


def test_after_a_clean_run_the_first_cleanup_failure_is_raised_after_all_ran():
    calls: list[str] = []
    with pytest.raises(RuntimeError, match="destroy_weights_update_group"):
        close_in_order(parts(calls))
    assert calls == ["weight sync", "rollout service", "report"]


def test_parts_that_were_never_built_are_skipped():
    calls: list[str] = []
    close_in_order([("weight sync", None), ("report", Part("report", calls).close)])
    assert calls == ["report"]
