"""The slurm tier: a real Slurm cluster of 3 virtual nodes on this machine
(tools/slurm_local.sh), started once per session and stopped at its end.

The daemons run as root, and slurm and munge are installed with apt-get where they are
missing. A machine that cannot do that (not root; no slurm and no apt-get) skips the tier
with that reason, so that a newcomer's `bash tools/run_tests.sh` says why instead of failing;
with MEGATRON_FR_REQUIRE_SLURM=1 (what .ci/run sets) the same reason fails every test here,
so CI cannot skip the tier silently. Once the prerequisites are there, a failed install or
start fails every test with the script's output. Jobs the tests submit are cancelled by id
before the daemons stop.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CLUSTER_SCRIPT = REPO / "tools" / "slurm_local.sh"
TERMINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}
REQUIRE_VARIABLE = "MEGATRON_FR_REQUIRE_SLURM"
PREREQUISITES = (
    f"needs root and apt-get to install slurm; set {REQUIRE_VARIABLE}=1 to make this an error"
)
SLURM_COMMANDS = ("slurmctld", "slurmd", "sbatch", "munged")  # what slurm_local.sh installs


def missing_prerequisite() -> str | None:
    """Why this machine cannot run the local cluster, or None when it can: the daemons of
    tools/slurm_local.sh run as root (SlurmUser=root, munged started by runuser), and it
    installs slurm and munge with apt-get where they are missing."""
    if os.geteuid() != 0:
        return f"{PREREQUISITES} (this machine: not root)"
    if shutil.which("apt-get") is None and not all(map(shutil.which, SLURM_COMMANDS)):
        return f"{PREREQUISITES} (this machine: slurm is not installed and there is no apt-get)"
    return None


def check_prerequisites() -> None:
    """Skip the tier, with the reason, where the machine lacks what it needs; fail instead
    where MEGATRON_FR_REQUIRE_SLURM=1 says the tier must run."""
    reason = missing_prerequisite()
    if reason is None:
        return
    if os.environ.get(REQUIRE_VARIABLE) == "1":
        pytest.fail(reason, pytrace=False)
    pytest.skip(reason)


@dataclass
class Cluster:
    """The running cluster: `env` points Slurm's clients at it (SLURM_CONF)."""

    env: dict[str, str]
    jobs: list[str] = field(default_factory=list)

    def run(self, *command: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run(
            command, env=self.env, capture_output=True, text=True, timeout=timeout, cwd=REPO
        )

    def submit(self, *command: str) -> str:
        """Run a launcher command that submits one job; its id (the last line printed)."""
        result = self.run(*command, timeout=120)
        assert result.returncode == 0, f"{shlex.join(command)}:\n{result.stdout}{result.stderr}"
        job_id = result.stdout.strip().splitlines()[-1]
        assert job_id.isdigit(), result.stdout
        self.jobs.append(job_id)
        return job_id

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as a dict (accounting is off: this is the record there is)."""
        result = self.run("scontrol", "show", "job", "-o", job_id)
        assert result.returncode == 0, result.stderr
        return dict(item.split("=", 1) for item in result.stdout.split() if "=" in item)

    def active(self, job_id: str) -> bool:
        """Pending, running or completing (a record Slurm has dropped is not)."""
        result = self.run("scontrol", "show", "job", "-o", job_id)
        return result.returncode == 0 and self.job(job_id)["JobState"] not in TERMINAL_STATES

    def wait(self, job_id: str, timeout_s: float, describe: Callable[[], str]) -> dict[str, str]:
        """The job's record once it is in a terminal state; fails after timeout_s with
        describe() (the job's logs)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if info["JobState"] in TERMINAL_STATES:
                return info
            time.sleep(1)
        pytest.fail(f"job {job_id} not finished after {timeout_s} s: {info}\n{describe()}")


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    check_prerequisites()
    directory = tmp_path_factory.mktemp("slurm")
    start = subprocess.run(
        ["bash", str(CLUSTER_SCRIPT), "start", str(directory)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    if start.returncode:
        pytest.fail(f"the local Slurm cluster did not start:\n{start.stdout}{start.stderr}")
    cluster = Cluster(env=os.environ | {"SLURM_CONF": str(directory / "slurm.conf")})
    try:
        yield cluster
    finally:
        for job_id in cluster.jobs:
            cluster.run("scancel", job_id)
        deadline = time.monotonic() + 60  # let slurmd see its steps end before it stops
        while any(cluster.active(job_id) for job_id in cluster.jobs):
            if time.monotonic() > deadline:
                break
            time.sleep(1)
        subprocess.run(["bash", str(CLUSTER_SCRIPT), "stop", str(directory)], timeout=120)
