"""The rollout service in a process of its own, started and stopped by the first learner rank.

    learner rank 0                        rollout process (spawned; dies with its parent)
    ProcessProxy[RunRollout] ── calls ──► RolloutHost: the RolloutService (engines, buffer,
                 ◄─ values / exceptions ─   episodes, sandboxes, rewards, evaluation:
                                            rollout/service.py) and its ShareSender
                                            ── data group ──► every stage leader
                                            (learner/delivery.py: each DP share, as tensors)

Why a process: the service's Python work (HTTP clients, tokenisation, rewards, agent loops)
would otherwise share the GIL with the thread that launches rank 0's kernels, and every other
rank would wait on rank 0 at each collective.

Rank 0 calls the RunRollout protocol through a generic proxy (utils/process_proxy.py): each
call keeps its types, a service error arrives with its class (EngineDied is EngineDied, so the
run ends with the first cause), and a process that died or did not answer is ProcessDied
naming its exit code. deliver_batch answers with the batch's summaries (no tokens: rank 0 logs
them) and then sends every stage leader its share.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from megatron_fr.buffer.trajectory import TrajectorySummary
from megatron_fr.config.run import RunConfig
from megatron_fr.learner.delivery import DataPathAddress, ShareSender
from megatron_fr.learner.step_plan import plan_step
from megatron_fr.orchestrator.setup import eval_sets, rollout_service_parts
from megatron_fr.rollout.control import RolloutControl
from megatron_fr.rollout.service import Evaluation, RolloutService
from megatron_fr.utils.process_proxy import ProcessProxy

START_TIMEOUT_S = 3600.0
"""Engines load models before the service answers its first call (SGLang: minutes)."""
CALL_TIMEOUTS_S = {"explain": 30.0, "close": 120.0}
"""The calls rank 0 makes while the run ends: each is waited for at most this long."""


@dataclass(frozen=True)
class Hello:
    """What every learner rank needs of the rollout process to start."""

    urls: list[str]
    pad_id: int
    address: DataPathAddress
    """Where the process hosts the data group."""


class RunRollout(RolloutControl, Protocol):
    """RolloutControl and what a run's rollout process adds to it."""

    def hello(self) -> Hello:
        """The engines' URLs, the tokenizer's padding id and the data group's address."""
        ...

    def deliver_batch(self, step: int, wait_s: float | None) -> list[TrajectorySummary] | None:
        """The batch for `step` (as summaries); its shares are on their way to the learners.
        None when no batch was ready within `wait_s` (None: wait as long as it takes)."""
        ...

    def begin_held_out_evaluation(self) -> None:
        """Start evaluating every held-out set at the run's eval settings."""
        ...

    def held_out_evaluation(self, wait_s: float) -> tuple[Evaluation, int] | None:
        """Every held-out set's (mean, spread), or why it has none, and the rollouts completed
        so far, once the evaluation begun has ended; None while it goes on after `wait_s`."""
        ...


def start_rollout_process(
    config: RunConfig, hf_dir: Path, run_dir: Path, address: DataPathAddress
) -> ProcessProxy[RunRollout]:
    """The rollout process, its engines started and healthy (not generating yet)."""
    return ProcessProxy[RunRollout](
        RunRollout,
        RolloutHost,
        (config, hf_dir, run_dir, address),
        name="rollout process",
        ready_timeout_s=START_TIMEOUT_S,
        timeouts=CALL_TIMEOUTS_S,
        after_reply=RolloutHost.finish_sending,
    )


class RolloutHost(RolloutService):
    """The service as the rollout process runs it: it also sends each batch's shares to the
    learners' stage leaders and evaluates at the run's settings."""

    def __init__(
        self, config: RunConfig, hf_dir: Path, run_dir: Path, address: DataPathAddress
    ) -> None:
        super().__init__(*rollout_service_parts(config, hf_dir, run_dir))
        self.config, self.address = config, address
        self.sender: ShareSender | None = None
        self._pending: list = []
        self._sender_ready = threading.Event()
        self._sender_error: BaseException | None = None
        # The stage leaders join the data group once rank 0 has hello's answer (the engines
        # may take minutes to start first: the group's wait begins only now).
        threading.Thread(target=self._connect, name="share-sender", daemon=True).start()

    def _connect(self) -> None:
        """The data group: waits for every stage leader's handshake."""
        try:
            self.sender = ShareSender(self.address)
        except BaseException as error:
            self._sender_error = error
        self._sender_ready.set()

    def hello(self) -> Hello:
        return Hello(self.engines.urls, self.producer.pad_id, self.address)

    def deliver_batch(self, step: int, wait_s: float | None) -> list[TrajectorySummary] | None:
        batch = self.next_batch(step, wait_s)
        if batch is None:
            return None
        if not self._sender_ready.wait(self.address.timeout_s) or self.sender is None:
            raise RuntimeError(f"the learners' data group did not form: {self._sender_error}")
        plan = plan_step(batch, self.config.learner, self.config.parallel, self.sender.dp_size)
        self._pending, _ = self.sender.send(batch, plan)
        return [t.summary() for t in batch]

    def finish_sending(self) -> None:
        """After each answer: finish sending the shares of the batch just answered (the
        learners receive them once rank 0 has the answer)."""
        for work in self._pending:
            work.wait()
        self._pending = []

    def begin_held_out_evaluation(self) -> None:
        config, producer = self.config, self.producer
        sampling = producer.sampling(config.eval.temperature, config.eval.top_p)
        self.begin_evaluation(eval_sets(config, producer), sampling, config.eval.timeout_s)

    def held_out_evaluation(self, wait_s: float) -> tuple[Evaluation, int] | None:
        results = self.evaluation_result(wait_s)
        return None if results is None else (results, self.stats().rollouts_total)
