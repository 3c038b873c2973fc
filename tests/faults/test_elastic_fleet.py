"""An elastic fleet through the real run: `megatron-fr train` on the CPU demo (2 gloo learner
ranks at EP2, the gloo weight broadcast) with a pool of three engines, two it starts and one
given by URL, hit by a seeded schedule of engine faults while it trains, each fault waiting
until the pool has recovered from the one before:

    SIGKILL of a started engine                 -> out, restarted, back in
    SIGSTOP of the URL engine past the deadline -> out; SIGCONT: answers again, re-admitted
    SIGSTOP of a started engine, then SIGKILL   -> the weight sync waiting on it fails and is
      while the learner waits in a weight sync     retried without it; restarted, back in
    SIGKILL of a started engine during an       -> the evaluation finishes on the others;
      evaluation                                   restarted, back in
    SIGSTOP of a started engine past the        -> out, killed by the run, restarted, back in
      deadline
    SIGKILL of the URL engine, a new one on     -> out, re-admitted when it answers
      its port
    a fourth engine listed in RUN_DIR/engines.txt -> joins and serves

Then a STOP file ends the run. It must exit 0 having logged every step exactly once, with the
three engines back and the fourth in, each serving; no trained trajectory older than max_lag
(the oldest token's version of each, from batches.jsonl); every problem handed out once per
epoch; faults.jsonl recording each event with the time each engine was out; nothing of the run
left. The learner never restarts."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest
from test_fault_injection import (
    assert_each_problem_once_per_epoch,
    prompt_files,
    start,
    url_engine,
)
from training_runs import Run, last_step, records, run_processes, step_rows, wait_until

MAX_LAG = 2  # the recipe's
EVAL_EVERY = 15
SETTINGS = [
    "steps=100000",  # a STOP file ends the run once the schedule is through
    "rollout.engine.count=2",
    "rollout.engine.unreachable_after_s=4",
    "rollout.engine.restart_backoff_s=1",
    "rollout.engine.restarts=3",
    "weights.timeout_s=20",
    f"eval.every_steps={EVAL_EVERY}",
    "eval.problems=120",
    "eval.samples=1",
    "checkpoint.every_steps=100000",
]
SEED = 7


class Fleet:
    """The run under test and what the test can see of its pool."""

    def __init__(self, run: Run, run_dir: Path) -> None:
        self.run, self.run_dir = run, run_dir

    def started(self) -> dict[str, int]:
        """URL -> pid of the engines the run started (CPU servers carrying its marker)."""
        engines = {}
        for process in run_processes(self.run.marker):
            command = process.cmdline()
            if "megatron_fr.engine.cpu.server" in command:
                engines[f"http://127.0.0.1:{command[command.index('--port') + 1]}"] = process.pid
        return engines

    def events(self) -> list[tuple[str, str]]:
        faults = records(self.run_dir, "faults.jsonl", running=True)
        return [(f["engine"], f["event"]) for f in faults]

    def wait_back(self, url: str, what: str) -> None:
        """Until `url` is in the pool one more time than it was out before this fault."""
        ins = self.events().count((url, "in"))
        self.run.wait_for(
            lambda: self.events().count((url, "in")) > ins, 300, f"{url} back in after {what}"
        )

    def steps(self) -> list[dict]:
        return step_rows(self.run_dir)

    def last_step(self) -> int:
        return last_step(self.run_dir)

    def evaluating(self) -> bool:
        """The last step logged is one that evaluates, and its evaluation is not logged yet."""
        rows = records(self.run_dir, running=True)
        step = max((r["step"] for r in rows if "reward_mean" in r), default=0)
        evaluated = {r["step"] for r in rows if "eval_accuracy" in r}
        return step > 0 and step % EVAL_EVERY == 0 and step not in evaluated

    def in_a_sync(self) -> bool:
        """The learner waits in a weight sync: the step counter holds for 1.5 s, once it has
        logged at most one more step (a step whose sync ended as the engine stopped is logged
        after its telemetry is gathered, up to a second later on a slow machine)."""
        before = self.last_step()
        time.sleep(1.5)
        moved = self.last_step()
        if moved == before:
            return True
        time.sleep(1.5)
        return moved == before + 1 and self.last_step() == moved


@pytest.mark.distributed
@pytest.mark.faults
def test_an_elastic_fleet_of_three_rides_out_six_engine_faults(tmp_path, demo_model):
    rng = random.Random(SEED)
    run_dir, marker = tmp_path / "run", uuid.uuid4().hex
    url_process, url = url_engine(demo_model, tmp_path / "url-engine.log")
    extra_process, extra = url_engine(demo_model, tmp_path / "extra-engine.log")
    spawned: list[subprocess.Popen[bytes]] = [url_process, extra_process]
    settings = [
        f"model.hf_dir={demo_model}",
        *prompt_files(tmp_path / "data"),
        *SETTINGS,
        f'rollout.engine.urls=["{url}"]',
    ]
    fleet = Fleet(start(run_dir, marker, settings), run_dir)
    run = fleet.run
    try:
        run.wait_for(lambda: fleet.last_step() >= 3, 600, "step 3")
        started = sorted(fleet.started())

        victim = rng.choice(started)  # 1. SIGKILL while it trains
        os.kill(fleet.started()[victim], signal.SIGKILL)
        fleet.wait_back(victim, "SIGKILL")

        os.kill(url_process.pid, signal.SIGSTOP)  # 2. hung past the deadline, then continued
        wait_until(lambda: (url, "out") in fleet.events(), 60, f"{url} taken out")
        os.kill(url_process.pid, signal.SIGCONT)
        fleet.wait_back(url, "SIGSTOP + SIGCONT")

        victim = rng.choice(started)  # 3. SIGKILL while the learner waits in a sync with it
        pid = fleet.started()[victim]
        os.kill(pid, signal.SIGSTOP)
        assert fleet.in_a_sync(), "the learner went on past a stopped engine"
        os.kill(pid, signal.SIGKILL)
        fleet.wait_back(victim, "SIGKILL during a weight sync")

        victim = rng.choice(started)  # 4. SIGKILL during an evaluation
        wait_until(fleet.evaluating, 300, "an evaluation under way")
        os.kill(fleet.started()[victim], signal.SIGKILL)
        fleet.wait_back(victim, "SIGKILL during an evaluation")

        victim = rng.choice(started)  # 5. hung past the deadline: the run kills it
        os.kill(fleet.started()[victim], signal.SIGSTOP)
        fleet.wait_back(victim, "SIGSTOP")

        url_process.kill()  # 6. the URL engine dies; a new one comes up on its port
        url_process.wait(30)
        wait_until(lambda: (url, "out") in fleet.events()[-3:], 60, f"{url} out")
        port = int(url.rsplit(":", 1)[1])
        replacement, _ = url_engine(demo_model, tmp_path / "url-engine-2.log", port)
        spawned.append(replacement)
        fleet.wait_back(url, "a new process on its port")

        (run_dir / "engines.txt").write_text(f"# grown mid-run\n{extra}\n")  # 7. growth
        fleet.wait_back(extra, "listed in engines.txt")
        joined_at = fleet.last_step()
        wait_until(lambda: fleet.last_step() >= joined_at + 3, 300, "three steps with four")
        run.stop_cleanly(run_dir)
    finally:
        run.kill()
        for process in spawned:
            if process.poll() is None:
                os.kill(process.pid, signal.SIGCONT)
                process.kill()
            process.wait(30)
    run.wait_gone()

    steps = fleet.steps()
    assert [r["step"] for r in steps] == list(range(1, len(steps) + 1)), run.output()[-3000:]
    batches = records(run_dir, "batches.jsonl")
    assert [b["step"] for b in batches] == [r["step"] for r in steps]
    for batch in batches:  # trained at policy version step - 1
        lags = [batch["step"] - 1 - oldest for oldest in batch["oldest_versions"]]
        assert max(lags) <= MAX_LAG, (batch["step"], lags)
    assert_each_problem_once_per_epoch(run_dir)

    faults = records(run_dir, "faults.jsonl")
    outs = [f for f in faults if f["event"] == "out"]
    assert len(outs) >= 6, outs
    causes = " | ".join(f["cause"] for f in outs)
    assert "exited with code -9" in causes and "has not answered GET /model_info" in causes
    back = [f for f in faults if f["event"] == "in" and f["engine"] != extra]
    assert len(back) == len(outs), faults
    last = steps[-1]
    assert last["engines_total"] == 4 and last["engines_serving"] == 4, last
    assert last["engines_out_total"] == len(outs), last
    requests = [
        v for k, v in last.items() if k.startswith("engine") and k.endswith("requests_total")
    ]
    assert len(requests) == 4 and all(count > 0 for count in requests), last
    lost = ", ".join(f"{f['engine'].rsplit(':', 1)[1]} {f['seconds_out']:.1f} s" for f in back)
    print(
        f"\nelastic fleet: {len(outs)} faults over {len(steps)} steps; time out per fault: "
        f"{lost}; {last['engine_seconds_lost']:.1f} engine-s lost in all; "
        f"groups failed {last['groups_failed_total']}, rollouts failed "
        f"{last['rollout_failures_total']}, discarded {last['discarded_total']}"
    )
