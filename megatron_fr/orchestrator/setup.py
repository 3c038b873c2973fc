"""Building a run's parts from its config: the rollout service and the weight sync (the
starting model and the episodes: orchestrator/workload.py).

Kept apart from the training loop (controller.py) so the loop reads like the data flow. The
rollout process (rollout_process.py) imports it too: nothing here may import megatron at the
top.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch.distributed as dist

from megatron_fr.buffer.lag_buffer import LagAwareBuffer
from megatron_fr.buffer.prompts import PromptSource
from megatron_fr.config.run import RunConfig
from megatron_fr.engine.client import RolloutClientConfig
from megatron_fr.engine.types import RoutedExpertsLayout, SamplingParams
from megatron_fr.orchestrator.workload import build_producer
from megatron_fr.rollout.episodes import EpisodeProducer
from megatron_fr.rollout.service import EvalSet
from megatron_fr.rollout.supervisor import EngineSupervisor
from megatron_fr.utils.net import free_port
from megatron_fr.weights.sync import GROUPS_FILE, WeightSync
from megatron_fr.weights.transports import Engine

if TYPE_CHECKING:
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_fr.models.hf_config import HFModelSpec


ServiceParts = tuple[
    EngineSupervisor, LagAwareBuffer, EpisodeProducer, RolloutClientConfig, SamplingParams
]
"""What a RolloutService is built of, in its constructor's order."""


def rollout_service_parts(config: RunConfig, hf_dir: Path, run_dir: Path) -> ServiceParts:
    """The rollout service's parts, its engines started and healthy (not generating yet)."""
    producer = build_producer(config, hf_dir)
    settings = config.rollout.engine
    routed = routed_experts_layout(hf_dir) if config.learner.routing_replay else None
    engines = EngineSupervisor.start(
        settings, hf_dir, run_dir / "logs", routed is not None, run_dir=run_dir
    )
    buffer = LagAwareBuffer(config.buffer, PromptSource(producer.train_problems, config.seed))
    client = RolloutClientConfig(
        urls=tuple(engines.urls),
        engine_kind=engines.kind,
        request_timeout_s=config.rollout.request_timeout_s,
        max_attempts=config.rollout.max_attempts,
        max_timeouts=config.rollout.max_timeouts,
        max_in_flight=config.rollout.max_in_flight_per_engine,
        routed_experts=routed,
        top_logprobs=config.learner.top_logprobs,
    )
    sampling = producer.sampling(config.rollout.temperature)
    if config.rollout.seeded:
        sampling = sampling.model_copy(update={"sampling_seed": config.seed})
    return engines, buffer, producer, client, sampling


def routed_experts_layout(hf_dir: Path) -> RoutedExpertsLayout:
    """What the engines report per position for routing replay: every layer's top-k."""
    from megatron_fr.models.hf_config import load_hf_config

    spec = load_hf_config(json.loads((hf_dir / "config.json").read_text()))
    if not spec.is_moe:
        raise ValueError("learner.routing_replay needs a MoE model; this one is dense")
    return RoutedExpertsLayout(
        num_layers=spec.num_layers, top_k=spec.num_experts_per_tok, num_experts=spec.num_experts
    )


def eval_sets(config: RunConfig, producer: EpisodeProducer) -> dict[str, EvalSet]:
    """Every held-out set, at most eval.problems problems each, with its k (the set's own
    `samples`, else eval.samples)."""
    files = getattr(config.task, "eval_sets", {})
    return {
        name: EvalSet(
            problems[: config.eval.problems],
            (files[name].samples if name in files else None) or config.eval.samples,
        )
        for name, problems in producer.eval_sets.items()
    }


def weight_sync_port(config: RunConfig) -> int:
    """Every learner rank: where the weight-update groups are hosted, weights.master_port or,
    where the recipe says 0, a free port picked by the first rank (each connect picks anew: a
    reconnect never waits for the old groups' port)."""
    # Imported here: megatron comes with it, and the rollout process, which builds its service
    # from this module, has no use for megatron (nor its CPU shims).
    from megatron_fr.parallel.state import broadcast_from_rank0

    return config.weights.master_port or broadcast_from_rank0(
        free_port() if dist.get_rank() == 0 else None
    )


def connect_weight_sync(
    config: RunConfig,
    urls: list[str],
    spec: HFModelSpec,
    run_dir: Path,
    groups: ProcessGroupCollection,
) -> WeightSync:
    """Every learner rank: the weight sync to the run's engines from the learner's process
    `groups`, its groups formed (the groups a previous start of this run left on long-lived
    engines destroyed first: their names are kept in RUN_DIR/weight_groups.json). Port 0 in
    the recipe means a free port picked by the first rank (single-node runs)."""
    settings = config.weights.model_copy(update={"master_port": weight_sync_port(config)})
    engines = [Engine(url) for url in urls]
    groups_file = run_dir / GROUPS_FILE
    weight_sync = WeightSync.from_config(settings, engines, spec, groups_file, groups)
    weight_sync.connect()
    return weight_sync
