"""Building a run's parts from its config: the starting model, the rollout service and the
weight sync.

Kept apart from the training loop (controller.py) so the loop reads like the data flow.
"""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from megatron_fr.buffer.lag_buffer import LagAwareBuffer
from megatron_fr.buffer.prompts import PromptSource
from megatron_fr.config.run import RunConfig
from megatron_fr.engine.client import RolloutClientConfig
from megatron_fr.parallel.spawn import free_port
from megatron_fr.parallel.state import broadcast_from_rank0
from megatron_fr.rollout.episodes import EpisodeProducer, TokenTaskEpisodes
from megatron_fr.rollout.service import EvalSet, RolloutService
from megatron_fr.rollout.supervisor import EngineSupervisor
from megatron_fr.weights.sync import WeightSync
from megatron_fr.weights.transports import Engine


def prepare_hf_model(config: RunConfig, run_dir: Path) -> Path:
    """The HF directory the engines serve first: model.hf_dir when the recipe names one,
    otherwise the task's tiny model warm-started into run_dir/warm_start (reused when made
    with the same settings). Runs in one process, before or without the learner ranks."""
    from megatron_fr.learner.warm_start import DEFAULT_WARM_START, warm_start
    from megatron_fr.tasks import build_task
    from megatron_fr.tasks.arithmetic import tiny_model_config

    if config.model.hf_dir:
        hf_dir = Path(config.model.hf_dir)
        if not (hf_dir / "config.json").is_file():
            raise FileNotFoundError(f"model.hf_dir {hf_dir}: no config.json there")
        return hf_dir
    hf_dir = run_dir / "warm_start"
    task = build_task(config.task)
    settings = DEFAULT_WARM_START | config.model.warm_start
    report = warm_start(hf_dir, task, tiny_model_config(), seed=config.seed, **settings)
    print(f"warm start: {report}", flush=True)
    return hf_dir


def build_producer(config: RunConfig) -> EpisodeProducer:
    """What the run's problems are and how an episode is played (the task)."""
    from megatron_fr.tasks import build_task

    task = build_task(config.task)
    return TokenTaskEpisodes(
        task, train_size=task.split_size("train"), eval_size=config.eval.problems, seed=config.seed
    )


def build_rollout_service(config: RunConfig, hf_dir: Path, run_dir: Path) -> RolloutService:
    """The rollout service with its engines started and healthy (not generating yet)."""
    producer = build_producer(config)
    settings = config.rollout.engine
    engines = EngineSupervisor.start(
        settings, hf_dir, run_dir / "logs", port=settings.port or free_port()
    )
    buffer = LagAwareBuffer(config.buffer, PromptSource(producer.train_problems, config.seed))
    client = RolloutClientConfig(
        urls=engines.urls,
        request_timeout_s=config.rollout.request_timeout_s,
        max_attempts=config.rollout.max_attempts,
    )
    sampling = producer.sampling(config.rollout.temperature)
    return RolloutService(engines, buffer, producer, client, sampling)


def eval_sets(config: RunConfig, producer: EpisodeProducer) -> dict[str, EvalSet]:
    return {
        name: EvalSet(problems[: config.eval.problems], config.eval.samples)
        for name, problems in producer.eval_sets.items()
    }


def connect_weight_sync(config: RunConfig, urls: list[str], spec) -> WeightSync:
    """Every learner rank: the weight sync to the run's engines, its groups formed. Port 0
    in the recipe means a free port picked by the first rank (single-node runs)."""
    port = config.weights.master_port or broadcast_from_rank0(
        free_port() if dist.get_rank() == 0 else None
    )
    settings = config.weights.model_copy(update={"master_port": port})
    weight_sync = WeightSync.from_config(settings, [Engine(url) for url in urls], spec)
    weight_sync.connect()
    return weight_sync
