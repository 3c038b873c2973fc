"""Everything of a run around the learner: engines, weight sync, buffer, rollouts, logs.

Rank 0 owns the engines it starts, the buffer, the prompt source, the rollout workers and the
logs; every rank takes part in the weight sync (the resharding gathers are collectives).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

from megatron_fr.buffer.lag_buffer import LagAwareBuffer
from megatron_fr.config.run import RunConfig
from megatron_fr.engine.client import RolloutClientConfig
from megatron_fr.engine.protocol import SamplingParams
from megatron_fr.orchestrator import checkpoints as ckpt
from megatron_fr.orchestrator.prompts import PromptSource
from megatron_fr.orchestrator.rollouts import RolloutWorkers, problem_of
from megatron_fr.orchestrator.run_log import METRICS_FILE, RunLogger, save_resolved_config
from megatron_fr.parallel.spawn import free_port
from megatron_fr.parallel.state import broadcast_from_rank0
from megatron_fr.weights.sync import SyncReport, WeightSync
from megatron_fr.weights.transports import Engine

BATCHES_FILE = "batches.jsonl"


class RolloutSession:
    def __init__(self, config: RunConfig, task, spec, hf_dir: Path, run_dir: Path, rank0: bool,
                 resume_from: Path | None):  # fmt: skip
        self.config, self.task, self.spec = config, task, spec
        self.hf_dir, self.run_dir, self.rank0 = hf_dir, run_dir, rank0
        self.resume_from = resume_from
        self.pad_id = task.pad_id
        self.engine_process = None
        self.workers: RolloutWorkers | None = None
        self.logger = None

    # --- start and stop -----------------------------------------------------------------

    def start(self, learner) -> None:
        version = learner.steps_done
        if self.rank0:
            self._open_logs(version)
        urls = broadcast_from_rank0(self._engine_urls() if self.rank0 else None)
        port = self.config.weights.master_port or broadcast_from_rank0(
            free_port() if self.rank0 else None
        )
        weights = self.config.weights.model_copy(update={"master_port": port})
        self.weight_sync = WeightSync.from_config(weights, [Engine(u) for u in urls], self.spec)
        self.weight_sync.connect()
        self.weight_sync.sync(learner.module, version)  # engines serve the learner's weights
        if self.rank0:
            self._start_rollouts(urls, version)

    def _open_logs(self, version: int) -> None:
        for name in (METRICS_FILE, BATCHES_FILE):
            ckpt.truncate_jsonl(self.run_dir / name, version)
        save_resolved_config(self.run_dir, self.config.model_dump(mode="json"))
        self.logger = RunLogger(self.run_dir, progress_total=self.config.steps)

    def _engine_urls(self) -> list[str]:
        settings = self.config.rollout.engine
        if settings.urls:
            return list(settings.urls)
        from megatron_fr.engine.launcher import ServerLaunchConfig, launch_server

        launch = ServerLaunchConfig(
            model_path=str(self.hf_dir), port=settings.port or free_port(),
            log_dir=self.run_dir / "logs", cpu_threads=settings.threads,
        )  # fmt: skip
        self.engine_process = launch_server(launch)
        self.engine_process.wait_healthy(deadline_s=300)
        return [self.engine_process.url]

    def _start_rollouts(self, urls: list[str], version: int) -> None:
        config, task = self.config, self.task
        train = task.problems("train", task.split_size("train"), seed=config.seed)
        evals = task.problems("eval", config.eval.problems, seed=config.seed)
        self.problems = {p.id: p for p in train + evals}
        self.eval_prompts = {p.id: p.prompt_ids for p in evals}
        self.buffer = LagAwareBuffer(config.buffer, version=version)
        source = PromptSource([p.id for p in train], seed=config.seed)
        self.rollouts_before = 0
        if self.resume_from is not None:
            self._restore(source)
        sampling = SamplingParams(
            temperature=config.rollout.temperature,
            max_new_tokens=task.max_new_tokens,
            stop_token_ids=list(task.stop_token_ids),
        )
        client = RolloutClientConfig(urls=urls, request_timeout_s=config.rollout.request_timeout_s)
        self.workers = RolloutWorkers(
            client, self.buffer, source, {p.id: p.prompt_ids for p in train + evals},
            lambda pid, ids: task.reward(self.problems[pid], ids),
            sampling, config.rollout.group_size,
        )  # fmt: skip
        self.workers.start()

    def _restore(self, source: PromptSource) -> None:
        """Buffer and cursor as checkpointed; prompts in flight then, or handed out but not
        yet admitted, are handed out again, once each."""
        state = ckpt.load_controller_state(self.resume_from)
        self.buffer.load_state_dict(state["buffer"])
        source.load_state_dict(state["prompts"])
        pending = {problem_of(p) for p in self.buffer.pop_requeued()}
        source.requeue(sorted(pending - set(state["prompts"]["requeued"])))
        self.rollouts_before = state["rollouts_total"]

    def close(self) -> None:
        if self.workers is not None:
            self.workers.stop()
        if self.engine_process is not None:
            self.engine_process.stop()
        if self.logger is not None:
            self.logger.close()

    # --- per step -----------------------------------------------------------------------

    def next_batch(self, version: int):
        """Rank 0: the next batch of B fresh trajectories (waits for the rollouts)."""
        if not self.rank0:
            return None
        while True:
            self.workers.check()
            batch = self.buffer.get_batch(version, timeout=2.0)
            if batch is not None:
                return batch

    def sync(self, learner, version: int) -> SyncReport:
        report = self.weight_sync.sync(learner.module, version)
        if self.rank0:
            self.buffer.set_version(version)
        return report

    @property
    def rollouts_total(self) -> int:
        return self.rollouts_before + (self.workers.completed if self.workers else 0)

    def log_step(self, step: int, batch, metrics: dict, sync: SyncReport, seconds: float):
        if not self.rank0:
            return
        lags = [step - 1 - t.oldest_version for t in batch]
        stats = self.buffer.stats()
        self.logger.log_step(
            dict(
                step=step,
                policy_version=step,
                reward_mean=statistics.fmean(t.reward for t in batch),
                acceptance_rate=metrics["acceptance_rate"],
                lag_mean=statistics.fmean(lags),
                lag_max=max(lags),
                tokens_per_s=sum(t.length for t in batch) / seconds,
                rollouts_total=self.rollouts_total,
                loss=metrics["loss"],
                grad_norm=metrics["grad_norm"],
                lr=metrics["lr"],
                sync_s=sync.seconds,
                buffer_occupancy=stats["occupancy"],
                dropped_total=stats["dropped_total"],
                step_s=seconds,
            )
        )
        _append_line(
            self.run_dir / BATCHES_FILE,
            {"step": step, "prompt_ids": [t.prompt_id for t in batch]},
        )

    def evaluate(self, step: int) -> None:
        if not self.rank0:
            return
        mean, spread = self.workers.evaluate(self.eval_prompts, self.config.eval.repeats)
        self.logger.log_eval(
            dict(step=step, rollouts_total=self.rollouts_total, eval_accuracy=mean,
                 eval_accuracy_std=spread)
        )  # fmt: skip

    def state_dict(self, step: int) -> dict:
        buffer, prompts = self.workers.snapshot()
        return dict(
            step=step,
            version=step,
            buffer=buffer,
            prompts=prompts,
            rollouts_total=self.rollouts_total,
            saved_at=time.time(),
        )


def _append_line(path: Path, record: dict) -> None:
    with open(path, "a") as handle:
        handle.write(json.dumps(record) + "\n")
        handle.flush()
        os.fsync(handle.fileno())
