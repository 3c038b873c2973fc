"""The rollout service in a process of its own, started and stopped by the first learner rank.

    learner rank 0                       rollout process (spawned; dies with its parent)
    RolloutProcess ── pipe: calls ──────► RolloutService (engines, buffer, episodes, sandboxes,
                   ◄─ replies / errors ──   rewards, evaluation: rollout/service.py)
                                          ShareSender ── data group ──► every stage leader
                                            (learner/delivery.py: each DP share, as tensors)

Why a process: the service's Python work (HTTP clients, tokenisation, rewards, agent loops)
would otherwise share the GIL with the thread that launches rank 0's kernels, and every other
rank would wait on rank 0 at each collective.

Each call is (method, arguments) answered by ("ok", value) or ("error", what happened); a
service error is raised on rank 0 as RolloutProcessError with its original message, and a
process that died (its pipe closed) as RolloutProcessError naming its exit code, so the run
ends with the first cause either way. next_batch answers with the batch's summary (no tokens:
rank 0 logs it) and then sends every stage leader its share.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import threading
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from megatron_fr.buffer.trajectory import TrajectorySummary
from megatron_fr.config.run import RunConfig
from megatron_fr.learner.delivery import DataPathAddress, ShareSender
from megatron_fr.learner.step_plan import plan_step
from megatron_fr.orchestrator.setup import build_rollout_service, eval_sets
from megatron_fr.rollout.service import Evaluation, RolloutService

START_TIMEOUT_S = 3600.0
"""Engines load models before the service answers its first call (SGLang: minutes)."""


class RolloutProcessError(RuntimeError):
    """The rollout process failed or died; the message is its first cause."""


@dataclass(frozen=True)
class Hello:
    urls: list[str]
    pad_id: int


class RolloutProcess:
    """Rank 0's handle on the rollout process: every call blocks until answered."""

    def __init__(
        self, config: RunConfig, hf_dir: Path, run_dir: Path, address: DataPathAddress
    ) -> None:
        context = mp.get_context("spawn")
        self._pipe, child = context.Pipe()
        self.process = context.Process(
            target=_child_main,
            args=(child, config, hf_dir, run_dir, address),
            name="megatron-fr-rollout",
            daemon=False,
        )
        self.process.start()
        child.close()
        try:
            self.hello: Hello = self._call("hello", timeout_s=START_TIMEOUT_S)
        except BaseException:
            self.close()  # no handle is returned to close it later
            raise

    def _call(self, method: str, *args: Any, timeout_s: float | None = None) -> Any:
        try:
            self._pipe.send((method, args))
            if timeout_s is not None and not self._pipe.poll(timeout_s):
                raise RolloutProcessError(
                    f"rollout process: no answer to {method} within {timeout_s:.0f} s"
                )
            status, value = self._pipe.recv()
        except (EOFError, BrokenPipeError, ConnectionResetError):
            self.process.join(timeout=5)
            raise RolloutProcessError(
                f"the rollout process (pid {self.process.pid}) exited with code "
                f"{self.process.exitcode} during {method}"
            ) from None
        if status == "error":
            raise RolloutProcessError(value)
        return value

    def start(self) -> None:
        self._call("start")

    def load_state_dict(self, state: dict) -> None:
        self._call("load_state_dict", state)

    def next_batch(self, step: int, wait_s: float | None = None) -> list[TrajectorySummary] | None:
        """The batch for `step` (as summaries); its shares are on their way to the learners.
        None when no batch was ready within `wait_s` (None: wait as long as it takes)."""
        return self._call("next_batch", step, wait_s)

    def membership(self) -> tuple[int, list[str]]:
        """The pool's epoch and the engines a weight sync must reach (rollout/supervisor.py)."""
        return self._call("membership")

    def synced(self, urls: list[str], version: int) -> None:
        """A weight sync reached `urls` at `version`: the engines joining among them serve."""
        self._call("synced", urls, version)

    def take_out(self, urls: list[str], cause: str) -> None:
        """The weight sync found `urls` not answering within its bound: out of the pool."""
        self._call("take_out", urls, cause)

    def set_version(self, version: int) -> None:
        self._call("set_version", version)

    def stats(self) -> dict:
        return self._call("stats")

    def evaluate(self) -> tuple[Evaluation, int]:
        """Every held-out set's (mean, spread), or why it has none, and the rollouts
        completed so far."""
        return self._call("evaluate")

    def state_dict(self) -> dict:
        return self._call("state_dict")

    def explain(self, error: BaseException) -> None:
        """Let the service name a dead engine behind `error` (best effort)."""
        with contextlib.suppress(RolloutProcessError):
            self._call("explain", str(error), timeout_s=30)

    def close(self) -> None:
        """Stop the service (engines, workers) and the process; idempotent."""
        if self.process.is_alive():
            with contextlib.suppress(RolloutProcessError):
                self._call("close", timeout_s=120)
        self.process.join(timeout=30)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self._pipe.close()


def _child_main(
    pipe: Connection, config: RunConfig, hf_dir: Path, run_dir: Path, address: DataPathAddress
) -> None:
    from megatron_fr.utils.parent_watch import exit_when_parent_dies

    exit_when_parent_dies()
    server = _Server(config, hf_dir, run_dir, address)
    try:
        while True:
            method, args = pipe.recv()
            try:
                value = server.call(method, args)
            except Exception as error:  # the service's own error ends the run on rank 0
                pipe.send(("error", f"{type(error).__name__}: {error}\n{traceback.format_exc()}"))
                continue
            pipe.send(("ok", value))
            server.after_reply()
            if method == "close":
                return
    except (EOFError, KeyboardInterrupt):
        server.close()


class _Server:
    """The child's side: the service, and the sender of the shares."""

    def __init__(
        self, config: RunConfig, hf_dir: Path, run_dir: Path, address: DataPathAddress
    ) -> None:
        self.config, self.hf_dir, self.run_dir, self.address = config, hf_dir, run_dir, address
        self._service: RolloutService | None = None
        self.sender: ShareSender | None = None
        self._pending: list = []
        self._sender_ready = threading.Event()
        self._sender_error: BaseException | None = None

    def call(self, method: str, args: tuple) -> Any:
        return getattr(self, f"_{method}")(*args)

    def after_reply(self) -> None:
        """Finish sending the shares of the batch just answered (the learners receive them
        once rank 0 has the answer)."""
        for work in self._pending:
            work.wait()
        self._pending = []

    @property
    def service(self) -> RolloutService:
        """The service hello built (every other call comes after it)."""
        if self._service is None:
            raise RolloutProcessError("the rollout service is called before hello built it")
        return self._service

    def close(self) -> None:
        if self._service is not None:
            self._service.close()

    def _hello(self) -> Hello:
        self._service = build_rollout_service(self.config, self.hf_dir, self.run_dir)
        # The stage leaders join the data group once rank 0 has this answer (the engines may
        # take minutes to start first: the group's wait begins only now).
        threading.Thread(target=self._connect, name="share-sender", daemon=True).start()
        return Hello(self._service.engines.urls, self._service.producer.pad_id)

    def _connect(self) -> None:
        """The data group: waits for every stage leader's handshake."""
        try:
            self.sender = ShareSender(self.address)
        except BaseException as error:
            self._sender_error = error
        self._sender_ready.set()

    def _start(self) -> None:
        self.service.start()

    def _load_state_dict(self, state: dict) -> None:
        self.service.load_state_dict(state)

    def _next_batch(self, step: int, wait_s: float | None) -> list[TrajectorySummary] | None:
        batch = self.service.next_batch(step, wait_s)
        if batch is None:
            return None
        if not self._sender_ready.wait(self.address.timeout_s) or self.sender is None:
            raise RolloutProcessError(
                f"the learners' data group did not form: {self._sender_error}"
            )
        plan = plan_step(batch, self.config.learner, self.config.parallel, self.sender.dp_size)
        self._pending, _ = self.sender.send(batch, plan)
        return [t.summary() for t in batch]

    def _membership(self) -> tuple[int, list[str]]:
        return self.service.membership()

    def _synced(self, urls: list[str], version: int) -> None:
        self.service.synced(urls, version)

    def _take_out(self, urls: list[str], cause: str) -> None:
        self.service.take_out(urls, cause)

    def _set_version(self, version: int) -> None:
        self.service.set_version(version)

    def _stats(self) -> dict:
        return self.service.stats()

    def _evaluate(self) -> tuple[Evaluation, int]:
        config, producer = self.config, self.service.producer
        sampling = producer.sampling(config.eval.temperature, config.eval.top_p)
        results = self.service.evaluate(
            eval_sets(config, producer), sampling, config.eval.timeout_s
        )
        return results, self.service.stats()["rollouts_total"]

    def _state_dict(self) -> dict:
        return self.service.state_dict()

    def _explain(self, error: str) -> None:
        self.service.explain(RuntimeError(error))

    def _close(self) -> None:
        self.close()
