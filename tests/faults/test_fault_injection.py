"""Fault injection through the real run: `megatron-fr train` (torchrun, 2 gloo learner ranks at
EP2, the CPU engine, the gloo weight broadcast) is hit by a seeded schedule of faults, and the
same command is started again after each: SIGKILL of the launcher, SIGKILL of learner rank 1,
SIGKILL of the inference engine, and two STOP-file stops. After every fault no process of the
run may be left (found by a marker in the environment every process of the run inherits);
with no restart allowed (rollout.engine.restarts=0) the engine's death must end the run
non-zero within 60 s naming the engine (test_elastic_fleet.py rides deaths out). The finished run
must have logged every step once, its optimizer step counts must be those of an uninterrupted
run (Adam's step = the optimizer step on every parameter of every rank), and every problem
must have been handed out once per epoch."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path

import psutil
import pytest
from training_runs import (
    Run,
    last_step,
    records,
    run_env,
    run_processes,
    step_rows,
    train_args,
    wait_until,
)

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "examples" / "cpu_demo.yaml"
STEPS = 14
SETTINGS = [
    f"steps={STEPS}",
    "checkpoint.every_steps=2",
    "checkpoint.keep=1",
    "eval.problems=24",
    "eval.samples=1",
    "eval.every_steps=0",
    "buffer.batch_size=16",
    "buffer.capacity=64",
    "buffer.max_in_flight=32",
    "rollout.engine.watch_interval_s=0.5",
    "rollout.engine.restarts=0",
]
TRAIN_PROBLEMS = 100
"""The train file's size: 14 steps of B = 16 cover more than two epochs of it, so the epoch
accounting is exercised."""
FAULTS = ["kill_launcher", "kill_rank", "kill_engine", "stop", "stop"]


def prompt_files(directory: Path) -> list[str]:
    """A train file of TRAIN_PROBLEMS demo problems, and the recipe's held-out file."""
    from megatron_fr.demo.text_math import TextMathConfig, write_rows

    directory.mkdir(parents=True, exist_ok=True)
    train = write_rows(directory / "train.jsonl", TextMathConfig(), "train", TRAIN_PROBLEMS, 0)
    return [f"task.train.path={train}"]


def start(run_dir: Path, marker: str, settings: list[str]) -> Run:
    """One start of the demo's training with SETTINGS and `settings`, its log beside
    `run_dir`; every start of one run shares its marker."""
    return Run(train_args(RECIPE, run_dir, *SETTINGS, *settings), run_dir.parent, marker)


def engine_process(marker: str) -> psutil.Process:
    """The CPU engine the run started."""
    return next(p for p in run_processes(marker) if "engine.cpu.server" in " ".join(p.cmdline()))


def has_engine(marker: str) -> bool:
    return any("engine.cpu.server" in " ".join(p.cmdline()) for p in run_processes(marker))


def port_of(engine: psutil.Process) -> str:
    command = engine.cmdline()
    return command[command.index("--port") + 1]


def inject(fault: str, run: Run, run_dir: Path, marker: str) -> None:
    """Apply one fault to a running start and check how that start ends."""
    if fault == "stop":
        run.stop_cleanly(run_dir)
        assert "stopped on request at step" in run.output()
        return
    if fault == "kill_launcher":
        victim = run.process.pid
    elif fault == "kill_rank":
        victim = next(p.pid for p in run_processes(marker) if p.environ().get("RANK") == "1")
    else:
        engine = engine_process(marker)
        victim, port = engine.pid, port_of(engine)
    killed_at = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    code = run.wait(120)
    if fault == "kill_engine":
        assert code != 0 and time.monotonic() - killed_at < 60, "engine death not noticed"
        named = f"inference engine http://127.0.0.1:{port} (pid {victim}) exited"
        assert named in run.output(), run.output()[-3000:]
    elif fault == "kill_rank":
        assert code != 0


def strike(fault: str, rng: random.Random, run_dir: Path, marker: str, settings: list[str]) -> None:
    """Start the run and hit it with `fault` 1 or 2 steps past the furthest step logged."""
    target = min(last_step(run_dir) + rng.randint(1, 2), STEPS - 1)
    with start(run_dir, marker, settings) as run:
        run.wait_for(lambda: last_step(run_dir) >= target, 600, f"step {target}")
        inject(fault, run, run_dir, marker)


@pytest.mark.distributed
@pytest.mark.faults
def test_seeded_faults_then_resume_finish_the_run_as_if_uninterrupted(tmp_path, demo_model):
    rng = random.Random(int(os.environ.get("FAULT_SEED", "7")))
    schedule = rng.sample(FAULTS, len(FAULTS))
    run_dir, marker = tmp_path / "run", uuid.uuid4().hex
    settings = [f"model.hf_dir={demo_model}", *prompt_files(tmp_path / "data")]
    print(f"fault schedule (FAULT_SEED={os.environ.get('FAULT_SEED', '7')}): {schedule}")
    for number, fault in enumerate(schedule):
        strike(fault, rng, run_dir, marker, settings)
        wait_until(lambda: not run_processes(marker), 30, f"no process left after {fault}")
        print(f"fault {number + 1} {fault}: struck at step {last_step(run_dir)}, run fully gone")
    with start(run_dir, marker, settings) as final:
        assert final.wait(900) == 0, final.output()[-4000:]
    final.wait_gone()

    steps = step_rows(run_dir)
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    for record in steps:  # an uninterrupted run: Adam's step equals the optimizer step
        assert record["adam_step_min"] == record["adam_step_max"] == record["step"], record
    assert [r["step"] for r in records(run_dir, "batches.jsonl")] == list(range(1, STEPS + 1))
    assert_each_problem_once_per_epoch(run_dir)


def assert_each_problem_once_per_epoch(run_dir: Path) -> None:
    """Trained problems plus those still outstanding at the end (queued, re-queued, in
    flight) must be exactly what the prompt cursor handed out: epoch e's problems each once,
    and the first `index` of the current epoch once more."""
    trained = Counter(
        prompt_id.rsplit("@", 1)[0]
        for record in records(run_dir, "batches.jsonl")
        for prompt_id in record["prompt_ids"]
    )
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    state = json.loads((run_dir / "checkpoints" / latest / "controller.json").read_text())
    buffer = state["rollout"]["buffer"]
    outstanding = Counter(buffer["source"]["requeued"])
    outstanding.update(g[0]["prompt_id"].rsplit("@", 1)[0] for g in buffer["queued"])
    outstanding.update(g["problem"] for g in buffer["interrupted"] if not g["failed"])
    handed_out = trained + outstanding
    epoch, index = buffer["source"]["epoch"], buffer["source"]["index"]
    assert epoch >= 1, "the run should cover more than one epoch"
    counts = Counter(handed_out.values())
    assert set(counts) <= {epoch, epoch + 1}, counts
    assert counts[epoch + 1] == index, (counts, index)


def served_version(url: str) -> str | None:
    """The engine's weight version, or None while it does not answer."""
    import urllib.request

    try:
        with urllib.request.urlopen(f"{url}/model_info", timeout=2) as answer:
            return json.loads(answer.read())["weight_version"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def url_engine(
    model: Path, log_path: Path, port: int | None = None
) -> tuple[subprocess.Popen[bytes], str]:
    """A CPU engine started outside the run, as a long-lived server given by URL is (on `port`,
    else a free one)."""
    from megatron_fr.utils.net import free_port

    port = port or free_port()
    command = [
        sys.executable,
        "-m",
        "megatron_fr.engine.cpu.server",
        "--model-path",
        str(model),
        "--port",
        str(port),
        "--threads",
        "1",
    ]
    log = open(log_path, "w")  # noqa: SIM115 (the process holds it)
    engine = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=run_env())
    return engine, f"http://127.0.0.1:{port}"


def post(url: str, path: str, body: dict) -> int:
    """The HTTP status of a POST (4xx and 5xx included)."""
    return post_answer(url, path, body)[0]


def post_answer(url: str, path: str, body: dict) -> tuple[int, str]:
    """The HTTP status and body of a POST (4xx and 5xx included)."""
    import urllib.error
    import urllib.request

    request = urllib.request.Request(
        url + path,
        json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status, answer.read().decode(errors="replace")
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode(errors="replace")


def leave_as_a_sync_cut_short(url: str) -> None:
    """Leave the engine paused with a weight-update session open, whether the kill landed
    inside a sync (which left both) or between syncs: the state is the test's, not the
    kill's timing."""
    assert post(url, "/pause_generation", {"mode": "abort"}) == 200  # idempotent
    status, text = post_answer(url, "/begin_weight_update", {})
    assert status == 200 or (status == 400 and "already open" in text), (status, text)


def kill_at_step(run: Run, run_dir: Path, target: int) -> None:
    """SIGKILL to every process of the start once it has logged step `target`."""
    with run:
        run.wait_for(lambda: last_step(run_dir) >= target, 600, f"step {target}")


@pytest.mark.distributed
@pytest.mark.faults
def test_an_engine_killed_during_an_evaluation_ends_the_run_within_60_s_naming_it(
    tmp_path, demo_model
):
    """SIGKILL of the engine while the step-0 evaluation runs (its 600 episodes take far
    longer than the test waits), no restart allowed: the run ends non-zero within 60 s, its
    last error names the engine (not the weight-update group it could no longer leave), no
    task's exception is left unretrieved (asyncio's "Task exception was never retrieved"), the
    console holds no traceback (the rank prints the error, the launcher one line), and
    nothing is left."""
    run_dir, marker = tmp_path / "run", uuid.uuid4().hex
    settings = [f"model.hf_dir={demo_model}", "eval.problems=200", "eval.samples=3"]
    with start(run_dir, marker, [*settings, *prompt_files(tmp_path / "data")]) as run:
        run.wait_for(lambda: has_engine(marker), 300, "the engine")
        engine = engine_process(marker)
        url = f"http://127.0.0.1:{port_of(engine)}"
        wait_until(lambda: served_version(url) == "0", 300, "the learner's weights served")
        time.sleep(3.0)  # the step-0 evaluation is under way
        assert not records(run_dir, running=True), "the evaluation ended before the kill"
        killed_at = time.monotonic()
        os.kill(engine.pid, signal.SIGKILL)
        code = run.wait(120)
        assert code != 0 and time.monotonic() - killed_at < 60, run.output()[-3000:]
    output = run.output()
    named = f"inference engine {url} (pid {engine.pid}) exited"
    assert named in output, output[-3000:]
    last_error = [line for line in output.splitlines() if "Error" in line][-1]
    assert "destroy_weights_update_group" not in last_error, output[-3000:]
    assert "Task exception was never retrieved" not in output, output[-3000:]
    # the ending is the engine's error and the launcher's line, no rank's or torchrun's
    # traceback and no task left pending at the rollout loop's close
    assert "Traceback" not in output and "Task was destroyed" not in output, output[-3000:]
    assert re.search(r"megatron-fr train: learner rank \d ended with code 1", output), output
    run.wait_gone()


@pytest.mark.distributed
@pytest.mark.faults
def test_learner_killed_twice_reconnects_to_the_same_long_lived_url_engine(tmp_path, demo_model):
    """The learner (launcher, ranks and all) is SIGKILLed twice against one CPU engine given by
    URL, each time left as a sync cut short leaves it: paused, an update session open, still a
    member of the dead learner's groups. Each restart clears that, forms groups under a name
    of its own, and the run finishes."""
    engine, url = url_engine(demo_model, tmp_path / "engine.log")
    run_dir, marker = tmp_path / "run", uuid.uuid4().hex
    settings = [
        f"model.hf_dir={demo_model}",
        *prompt_files(tmp_path / "data"),
        "steps=6",
        f'rollout.engine.urls=["{url}"]',
    ]
    groups_file = run_dir / "weight_groups.json"
    names: list[str] = []
    try:
        for target in (2, 4):
            kill_at_step(start(run_dir, marker, settings), run_dir, target)
            wait_until(lambda: not run_processes(marker), 30, "no process of the learner left")
            names += json.loads(groups_file.read_text())["groups"]
            # its group is still there: the dead learner never destroyed it
            leave_as_a_sync_cut_short(url)
        with start(run_dir, marker, settings) as final:
            assert final.wait(900) == 0, final.output()[-4000:]
        assert engine.poll() is None, "the URL engine must outlive every learner"
        names += json.loads(groups_file.read_text())["groups"]
        assert len(set(names)) == 3, names  # a fresh group name at every start
        for name in names:  # the first two destroyed by the next start, the last at its end
            assert post(url, "/destroy_weights_update_group", {"group_name": name}) == 400
    finally:
        engine.kill()
        engine.wait(60)
    assert [r["step"] for r in step_rows(run_dir)] == list(range(1, 7))
