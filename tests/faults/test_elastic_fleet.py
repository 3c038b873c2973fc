"""An elastic fleet through the real run: `megatron-fr train` (2 gloo learner ranks at EP2, the
gloo weight broadcast) with a pool of two CPU engines it starts and one given by URL, hit by an
engine fault after another while it trains:

    SIGKILL of a started engine        -> out, restarted, back in
    SIGSTOP of the other started one   -> out after unreachable_after_s (hung), killed,
                                          restarted, back in
    SIGKILL of the URL engine, then a  -> out, re-admitted when it answers again
    new one on its port
    a fourth engine listed in          -> joins the pool and serves
    RUN_DIR/engines.txt

Then a STOP file ends it. The run must have logged every step exactly once and exit 0; every
engine that came back (or joined) must serve the learner's weights and receive requests;
faults.jsonl must record each event; the metrics count them and the engine-seconds lost;
nothing of the run is left after it. The learner never restarts."""

from __future__ import annotations

import os
import signal
import subprocess
import uuid
from pathlib import Path

import pytest
from test_fault_injection import (
    Run,
    prompt_files,
    records,
    run_processes,
    url_engine,
    wait_until,
)

SETTINGS = [
    "steps=1000",  # more than the faults take: a STOP file ends the run
    "rollout.engine.count=2",
    "rollout.engine.unreachable_after_s=4",
    "rollout.engine.restart_backoff_s=1",
    "rollout.engine.restarts=2",
    "weights.timeout_s=20",
    "checkpoint.every_steps=100",
]


def started_engines(marker: str) -> dict[str, int]:
    """URL -> pid of the engines the run started (the CPU servers carrying its marker)."""
    engines = {}
    for process in run_processes(marker):
        command = process.cmdline()
        if "megatron_fr.engine.cpu_server" in command:
            engines[f"http://127.0.0.1:{command[command.index('--port') + 1]}"] = process.pid
    return engines


def faults(run_dir: Path) -> list[tuple[str, str]]:
    return [(f["engine"], f["event"]) for f in records(run_dir, "faults.jsonl")]


def back_in(run_dir: Path, url: str, times: int = 1) -> bool:
    return faults(run_dir).count((url, "in")) >= times


def last_step(run_dir: Path) -> int:
    return max((r["step"] for r in records(run_dir, "metrics.jsonl")), default=0)


@pytest.mark.distributed
@pytest.mark.faults
def test_an_elastic_fleet_rides_out_engine_faults(tmp_path, demo_model):
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
    run = Run(run_dir, marker, settings)
    try:
        wait_until(lambda: last_step(run_dir) >= 2 or run.process.poll() is not None, 600, "step 2")
        assert run.process.poll() is None, run.output()[-4000:]
        (killed, killed_pid), (stopped, stopped_pid) = sorted(started_engines(marker).items())

        os.kill(killed_pid, signal.SIGKILL)
        wait_until(lambda: back_in(run_dir, killed), 300, f"{killed} back in")

        os.kill(stopped_pid, signal.SIGSTOP)
        wait_until(lambda: back_in(run_dir, stopped), 300, f"{stopped} back in")
        assert stopped_pid not in started_engines(marker).values()

        url_process.kill()
        url_process.wait(30)
        wait_until(lambda: (url, "out") in faults(run_dir), 120, f"{url} out")
        port = int(url.rsplit(":", 1)[1])
        replacement, _ = url_engine(demo_model, tmp_path / "url-engine-2.log", port)
        spawned.append(replacement)
        wait_until(lambda: back_in(run_dir, url), 300, f"{url} back in")

        (run_dir / "engines.txt").write_text(f"# grown mid-run\n{extra}\n")
        wait_until(lambda: back_in(run_dir, extra), 300, f"{extra} in")
        joined_at = last_step(run_dir)
        wait_until(lambda: last_step(run_dir) >= joined_at + 2, 300, "two steps with four")
        (run_dir / "STOP").touch()
        assert run.wait(300) == 0, run.output()[-4000:]
    finally:
        if run.process.poll() is None:
            os.killpg(run.process.pid, signal.SIGKILL)
            run.wait(60)
        for process in spawned:
            process.kill()
            process.wait(30)
    output = run.output()
    wait_until(lambda: not run_processes(marker), 30, "no process of the run left")

    steps = [r["step"] for r in records(run_dir, "metrics.jsonl") if "reward_mean" in r]
    assert steps == list(range(1, len(steps) + 1)), output[-3000:]
    events = faults(run_dir)
    for engine in (killed, stopped, url):
        assert (engine, "out") in events and (engine, "in") in events, events
    assert (extra, "joining") in events and (extra, "in") in events, events
    outs = [f for f in records(run_dir, "faults.jsonl") if f["event"] == "out"]
    causes = {f["engine"]: f["cause"] for f in outs}
    assert "exited with code -9" in causes[killed], causes
    assert "has not answered GET /model_info for 4 s" in causes[stopped], causes

    last = [r for r in records(run_dir, "metrics.jsonl") if "reward_mean" in r][-1]
    assert last["engines_total"] == 4 and last["engines_serving"] == 4, last
    assert last["engines_out_total"] == 3 and last["engines_restarted_total"] == 2, last
    assert last["engine_seconds_lost"] > 4.0, last
    after = {k: v for k, v in last.items() if k.endswith("_requests_total")}
    assert all(count > 0 for count in after.values()), after  # the joined one served too
    print(
        f"\nelastic fleet: {len(events)} pool events, {last['engines_out_total']} engines out, "
        f"{last['engine_seconds_lost']:.1f} engine-s lost, groups failed "
        f"{last['groups_failed_total']}, rollout failures {last['rollout_failures_total']}"
    )
