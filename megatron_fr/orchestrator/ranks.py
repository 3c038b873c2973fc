"""The learner's ranks as objects: one leader, the others followers, with one interface.

    Leader (the first rank)   the rollout process, the run's report, the controller's part
                              of each checkpoint; what it learns it shares with every rank
    Follower (every other)    holds none of them: it receives what the leader shares and
                              skips what the leader alone does

So the training loop (controller.py) and the pool's sync (pool_sync.py) read the same on every
rank: work that only the leader can do is a function of the Leader, handed to `act` (the
leader runs it, a follower does nothing), `share` (the leader's answer, broadcast to every
rank: the loop's one way to broadcast) or `run` (the leader runs it on a thread while every
rank meets in slices: parallel/state.py run_on_rank0).
"""

from __future__ import annotations

import contextlib
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from megatron_fr.buffer.trajectory import TrajectorySummary
from megatron_fr.config.run import RunConfig
from megatron_fr.learner.delivery import DataPathAddress
from megatron_fr.learner.step_metrics import StepMetrics
from megatron_fr.orchestrator import checkpoints as ckpt
from megatron_fr.orchestrator.report import RunReport
from megatron_fr.orchestrator.rollout_process import Hello, RunRollout, start_rollout_process
from megatron_fr.parallel.state import run_on_rank0, share_from_rank0
from megatron_fr.utils.process_proxy import ProcessProxy

T = TypeVar("T")
STOP_FILE = "STOP"
"""Created in the run directory (by a Slurm USR1 trap, or by hand), it ends the run at the
step reached, within seconds of any wait (orchestrator/pool_sync.py), with a checkpoint of
that step; the same command then resumes from there."""
Closers = list[tuple[str, Callable[[], object] | None]]


class Rank(ABC):
    """What every rank of the loop calls; the leader and the followers answer it each their
    way."""

    leads: bool
    """Whether this rank is the leader: for parts that only say things (SkippedSteps)."""

    @abstractmethod
    def share(self, ask: Callable[[Leader], T]) -> T:
        """Every rank: what `ask` returns on the leader (a collective); an error of `ask` is
        raised on the leader, and as FirstRankFailed on the others (share_from_rank0)."""

    @abstractmethod
    def act(self, work: Callable[[Leader], object]) -> None:
        """The leader does `work`; a follower nothing."""

    @abstractmethod
    def run(self, work: Callable[[Leader], T], slice_s: float) -> T:
        """Every rank: what `work` returns on the leader, every rank meeting every `slice_s`
        seconds while it runs (a collective)."""

    @abstractmethod
    def closers(self) -> Closers:
        """What this rank closes when the run ends, in order."""

    def say(self, text: str) -> None:
        """Print on the leader, flushed: one line of the run's log, not one per rank."""
        self.act(lambda _: print(text, flush=True))

    def membership(self) -> tuple[int, list[str]]:
        """Every rank: the pool's epoch and the engines a weight sync must reach."""
        return self.share(lambda lead: lead.rollout.membership())

    def synced(self, urls: list[str], version: int) -> None:
        self.act(lambda lead: lead.rollout.synced(urls, version))

    def take_out(self, urls: list[str], cause: str) -> None:
        self.act(lambda lead: lead.rollout.take_out(urls, cause))


class Leader(Rank):
    """The first learner rank."""

    leads = True

    def __init__(
        self, process: ProcessProxy[RunRollout], hello: Hello, report: RunReport, run_dir: Path
    ) -> None:
        self.process, self.hello, self.report = process, hello, report
        self.rollout = process.remote
        self.stop_file = run_dir / STOP_FILE

    @classmethod
    def start(
        cls,
        config: RunConfig,
        dirs: tuple[Path, Path],
        address: DataPathAddress,
        resume_from: Path | None,
        resume_point: tuple[int, int],
    ) -> Leader:
        """The rollout process (`dirs`: the model's, the run's) with its state restored when
        resuming, and the report; `resume_point`: the steps done and the newer checkpoints
        set aside."""
        hf_dir, run_dir = dirs
        process = start_rollout_process(config, hf_dir, run_dir, address)
        try:
            hello = process.remote.hello()
            if resume_from is not None:
                state = ckpt.load_controller_state(resume_from)["rollout"]
                process.remote.load_state_dict(state)
                print(f"resumed from {resume_from} (step {resume_point[0]})", flush=True)
            return cls(process, hello, RunReport(config, run_dir, *resume_point), run_dir)
        except BaseException:
            process.close()  # no handle is returned to close it later
            raise

    def share(self, ask: Callable[[Leader], T]) -> T:
        return share_from_rank0(lambda: ask(self))

    def act(self, work: Callable[[Leader], object]) -> None:
        work(self)

    def run(self, work: Callable[[Leader], T], slice_s: float) -> T:
        return run_on_rank0(lambda: work(self), slice_s)

    def closers(self) -> Closers:
        return [("rollout process", self.process.close), ("run report", self.report.close)]

    def stop_requested(self) -> bool:
        """Whether a STOP file is in the run directory (a request to stop with a checkpoint)."""
        return self.stop_file.exists()

    def explain(self, error: BaseException) -> None:
        """Let the service name a dead engine behind `error` (best effort: the learner's error
        is raised whatever this finds)."""
        with contextlib.suppress(Exception):
            self.rollout.explain(RuntimeError(str(error)))

    def report_step(
        self,
        step: int,
        summaries: list[TrajectorySummary],
        metrics: tuple[StepMetrics, dict[str, float]],
        sync_s: float,
        started: float,
    ) -> None:
        """The step's record (`metrics`: the learner's and the step's other figures), once
        the buffer's version moved to `step`: the step's seconds are counted from `started`
        to then."""
        self.rollout.set_version(step)
        seconds = time.monotonic() - started
        learner, figures = metrics
        stats = self.rollout.stats()
        lengths = self.rollout.take_lengths()
        self.report.step(step, summaries, learner, figures, sync_s, stats, lengths, seconds)


class Follower(Rank):
    """Every learner rank but the first."""

    leads = False

    def share(self, ask: Callable[[Leader], T]) -> T:
        return share_from_rank0(None)

    def act(self, work: Callable[[Leader], object]) -> None:
        pass

    def run(self, work: Callable[[Leader], T], slice_s: float) -> T:
        return run_on_rank0(None, slice_s)

    def closers(self) -> Closers:
        return []
