"""The CPU recipe through the real launcher on a real 3-node Slurm cluster (conftest.py):
`slurm/recipes/cpu_demo.sh` submits with sbatch; the job runs the CPU engine on n1, serving the
recipe's model (the demo model, made beforehand), and two learner ranks (torchrun, one per
node) on n2 and n3, to completion. Then
the preemption path: USR1 to the batch shell -> RUN_DIR/STOP -> checkpoint -> scontrol requeue
-> the rerun (SLURM_RESTART_COUNT=1) resumes from that checkpoint and finishes the run."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slurm, pytest.mark.distributed]  # ranks on several virtual nodes

WRAPPER = str(Path(__file__).resolve().parents[2] / "slurm" / "recipes" / "cpu_demo.sh")
QUICK = [
    "eval.problems=40",
    "eval.samples=2",
    "eval.every_steps=0",
    "buffer.batch_size=16",
    "buffer.capacity=64",
    "buffer.max_in_flight=32",
]
JOB_TIMEOUT_S = 600


def steps_logged(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line]
    return [row["step"] for row in rows if "reward_mean" in row]


def logs_of(run_dir: Path, job_id: str) -> str:
    """The batch log and the tail of every step log, for failure messages."""
    parts = []
    for path in [
        run_dir / "logs" / f"slurm-{job_id}.out",
        *sorted((run_dir / "logs").glob(f"slurm-{job_id}.*/*")),
    ]:
        if path.is_file():
            parts.append(f"--- {path.name}\n" + "\n".join(path.read_text().splitlines()[-15:]))
    return "\n".join(parts)


def finished_ok(cluster, job_id: str, run_dir: Path) -> dict[str, str]:
    info = cluster.wait(job_id, JOB_TIMEOUT_S, lambda: logs_of(run_dir, job_id))
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (
        f"{info}\n{logs_of(run_dir, job_id)}"
    )
    return info


@pytest.fixture(scope="module")
def cpu_run(slurm_cluster, demo_model: Path, tmp_path_factory: pytest.TempPathFactory):
    """One short run of the CPU recipe from the quickly warm-started demo model."""
    run_dir = tmp_path_factory.mktemp("slurm-run") / "run"
    job_id = slurm_cluster.submit(
        WRAPPER,
        "--run-dir",
        str(run_dir),
        "--health-timeout-s",
        "300",
        *QUICK,
        "steps=4",
        f"model.hf_dir={demo_model}",
    )
    info = finished_ok(slurm_cluster, job_id, run_dir)
    return run_dir, job_id, info


def test_cpu_recipe_runs_engine_on_n1_and_learner_ranks_on_n2_n3(cpu_run):
    run_dir, job_id, info = cpu_run
    assert info["Restarts"] == "0" and info["NodeList"] == "n[1-3]"
    assert steps_logged(run_dir) == [1, 2, 3, 4]
    logs = run_dir / "logs" / f"slurm-{job_id}.0"
    assert sorted(p.name for p in logs.iterdir()) == [
        "learner-n2.log",
        "learner-n3.log",
        "rank-0-n2.log",
        "rank-1-n3.log",
        "server-n1-0.log",
    ]
    assert "server 0 on n1 port 20100" in (logs / "server-n1-0.log").read_text()
    assert "learner node n2 node_rank 0" in (logs / "learner-n2.log").read_text()
    assert "learner node n3 node_rank 1" in (logs / "learner-n3.log").read_text()
    assert (logs / "rank-0-n2.log").read_text().startswith("rank 0 of 2 (local 0) on n2")
    assert (logs / "rank-1-n3.log").read_text().startswith("rank 1 of 2 (local 0) on n3")
    batch_log = (run_dir / "logs" / f"slurm-{job_id}.out").read_text()
    assert "nodes: rollout n1; learner n2 n3" in batch_log and "run finished" in batch_log
    # The learner was pointed at the server the job started, not one of its own.
    assert "http://127.0.0.1:20100" in batch_log
    assert not (run_dir / "logs" / "server-20100.log").exists()
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_00000004"


def test_usr1_checkpoints_requeues_and_the_rerun_resumes(slurm_cluster, demo_model, tmp_path):
    run_dir = tmp_path / "run"
    job_id = slurm_cluster.submit(
        WRAPPER,
        "--run-dir",
        str(run_dir),
        "--health-timeout-s",
        "300",
        "--time",
        "30",
        "--signal-lead-s",
        "60",
        *QUICK,
        "steps=10",
        "checkpoint.every_steps=100",
        f"model.hf_dir={demo_model}",
    )
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while max(steps_logged(run_dir), default=0) < 2:
        assert time.monotonic() < deadline, logs_of(run_dir, job_id)
        assert slurm_cluster.job(job_id)["JobState"] in ("PENDING", "RUNNING"), logs_of(
            run_dir, job_id
        )
        time.sleep(0.5)
    # What Slurm does --signal-lead-s before the time limit (or a preemption), done now.
    signal = slurm_cluster.run("scancel", "--signal=USR1", "--batch", job_id)
    assert signal.returncode == 0, signal.stderr
    info = finished_ok(slurm_cluster, job_id, run_dir)
    assert info["Restarts"] == "1", f"{info}\n{logs_of(run_dir, job_id)}"

    first, rerun = (run_dir / "logs" / f"slurm-{job_id}.{n}" for n in (0, 1))
    stopped = re.search(r"stopped on request at step (\d+)", (first / "rank-0-n2.log").read_text())
    assert stopped, logs_of(run_dir, job_id)
    stopped_at = int(stopped.group(1))
    assert 2 <= stopped_at < 10
    batch_log = (run_dir / "logs" / f"slurm-{job_id}.out").read_text()
    assert "USR1" in batch_log and f"requeueing job {job_id}" in batch_log
    rank0 = (rerun / "rank-0-n2.log").read_text()
    assert rank0.startswith("rank 0 of 2 (local 0) on n2 restart 1")  # SLURM_RESTART_COUNT=1
    assert f"resumed from {run_dir / 'checkpoints'}/step_{stopped_at:08d} (step {stopped_at})" in (
        rank0
    )
    assert "server 0 on n1" in (rerun / "server-n1-0.log").read_text()
    assert steps_logged(run_dir) == list(range(1, 11)), "the rerun restarted the step count"
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_00000010"
    assert not (run_dir / "STOP").exists()
