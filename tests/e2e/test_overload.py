"""Overload through the real run: the CPU demo, with GRPO, on one CPU engine
given by URL behind a proxy that makes it a busy engine (test_grpo_loop.FlakyProxy's pace):
one /generate at a time, 0.6 s each plus the engine's own time, so 32 rollouts in flight wait
20 s or more while an answer comes every second or so. With a 10 s request timeout, well below
that service time (and the stall window, 8 s, below it as the config requires), most
requests past the first dozen time out until the client has lowered the engine's requests in
flight. Slow is not dead: every step must finish with whole groups, the engine must never be
taken out (faults.jsonl empty), timeouts must have happened and lowered the limit (else the
test proves nothing), and every evaluation must be honest (all its episodes scored) or
marked incomplete, never 0 from an outage. GRPO is the stricter case of the two estimators:
on top of every step finishing, each of its batches must hold whole groups although requests
time out and are retried (FlashREINFORCE's single rollouts take the same client path, and its
faults are tested in tests/faults). Run with -s to print the figures."""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import pytest
from test_grpo_loop import FlakyProxy
from training_runs import records, run_megatron_fr, served_cpu_engine, step_rows, train_args

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "examples" / "cpu_demo.yaml"
STEPS = 3
G = 4
IN_FLIGHT = 32
PACE_S = 0.6
OVERLOAD = [
    f"steps={STEPS}",
    "buffer.batch_size=16",
    "buffer.capacity=64",
    f"buffer.max_in_flight={IN_FLIGHT}",
    "eval.problems=16",
    "eval.samples=1",
    "eval.every_steps=0",
    "eval.timeout_s=300",
    "rollout.engine.count=0",
    "rollout.engine.start_timeout_s=120",
    "rollout.request_timeout_s=10.0",
    "rollout.engine.stalled_after_s=8.0",
    "rollout.engine.watch_interval_s=0.2",
]
GRPO = ["learner.estimator=grpo", f"buffer.group_size={G}"]


@pytest.mark.distributed
@pytest.mark.faults
def test_a_run_whose_requests_time_out_finishes_every_step_without_a_restart(tmp_path, demo_model):
    run_dir = tmp_path / "run"
    with (
        served_cpu_engine(demo_model) as url,
        FlakyProxy(url, every=0, pace_s=PACE_S) as proxy,
    ):
        settings = [f"model.hf_dir={demo_model}", *OVERLOAD, *GRPO]
        settings.append(f"rollout.engine.urls=['http://127.0.0.1:{proxy.port}']")
        started = time.monotonic()
        run_megatron_fr(*train_args(RECIPE, run_dir, *settings))
        wall_s = time.monotonic() - started

    metrics = records(run_dir)
    steps = step_rows(run_dir)
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    last = steps[-1]
    assert records(run_dir, "faults.jsonl") == []  # no engine taken out, none restarted
    assert last["engines_out_total"] == 0 and last["engines_restarted_total"] == 0
    assert last["engine0_timeouts_total"] > 0, last  # the overload happened
    assert last["engine0_in_flight_limit"] < IN_FLIGHT, last  # and was answered by a lower limit
    for batch in records(run_dir, "batches.jsonl"):
        sizes = Counter(p.rsplit("#", 1)[0] for p in batch["prompt_ids"])
        assert set(sizes.values()) == {G}, sizes

    evals = [r for r in metrics if "eval_accuracy" in r]
    assert [r["step"] for r in evals] == [0, STEPS]
    for evaluation in evals:
        if evaluation["eval_incomplete"]:
            assert evaluation["eval_accuracy"] is None, evaluation
            assert evaluation["eval_incomplete_reason"], evaluation
        else:
            assert 0 <= evaluation["eval_accuracy"] <= 1, evaluation
    summary = [(r["step"], r["eval_accuracy"], r["eval_failed_episodes"]) for r in evals]
    print(
        f"grpo: {STEPS} steps in {wall_s:.0f} s, "
        f"{proxy.dropped} timed-out requests dropped from the queue, "
        f"{last['engine0_timeouts_total']} timeouts of {last['engine0_requests_total']} "
        f"requests, in-flight limit {last['engine0_in_flight_limit']} at the end, "
        f"{last['engines_out_total']} take-outs, {last['engines_restarted_total']} restarts, "
        f"evaluations (step, accuracy, failed episodes): {summary}"
    )
