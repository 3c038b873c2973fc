"""At a sampling temperature != 1 the learner scores tokens under the distribution the engine
sampled from: through 2 real learner ranks (EP2, gloo), the gloo weight broadcast into the CPU
engine, the real rollout client at temperature 0.6, the learner's log-probs of the sampled
tokens equal the engine's within 1e-5, and the gate admits every one of these on-policy
trajectories. The same tokens scored at temperature 1 differ (what a learner that ignored the
temperature would compute)."""

from __future__ import annotations

import asyncio

import pytest
import torch
from tiny_qwen import TINY, to_megatron_on_rank

from megatron_fr.parallel.spawn import run_on_ranks
from megatron_fr.utils.net import free_port

TEMPERATURE = 0.6
CONFIG = dict(TINY["qwen3_moe"], router_aux_loss_coef=0.0)


async def _sample(url: str, count: int):
    from trajectory_fixtures import single_turn_trajectory

    from megatron_fr.engine.client import RolloutClient, RolloutClientConfig
    from megatron_fr.engine.sglang.protocol import SamplingParams

    sampling = SamplingParams(temperature=TEMPERATURE, max_new_tokens=10)
    async with RolloutClient(RolloutClientConfig(urls=[url], request_timeout_s=60)) as client:
        rollouts = await asyncio.gather(
            *(client.generate([3 + k, 17, 42, 5 + k], sampling) for k in range(count))
        )
    return [
        single_turn_trajectory(f"p{k}@0#0", r, reward=float(k % 2), info={"group": f"p{k}@0"})
        for k, r in enumerate(rollouts)
    ]


def score_on_rank(rank: int, world_size: int, megatron_dir: str, url: str, port: int):
    import json
    from pathlib import Path

    from megatron_fr.config import FlashReinforceConfig, LearnerConfig, ParallelConfig
    from megatron_fr.config.weights import WeightSyncConfig
    from megatron_fr.learner.trainer import Learner
    from megatron_fr.models.hf_config import load_hf_config
    from megatron_fr.parallel import state
    from megatron_fr.parallel.state import broadcast_from_rank0
    from megatron_fr.weights.sync import WeightSync
    from megatron_fr.weights.transports import Engine

    parallel = ParallelConfig(expert=2)
    state.initialize(parallel, seed=0)
    spec = load_hf_config(json.loads((Path(megatron_dir).parent / "hf/config.json").read_text()))
    config = LearnerConfig(
        params_dtype="float32", lr=1e-4, flash_reinforce=FlashReinforceConfig(delta=1e-6)
    )
    learner = Learner(
        spec, parallel, config, total_steps=2, init_checkpoint=megatron_dir, temperature=TEMPERATURE
    )
    sync = WeightSync.from_config(
        WeightSyncConfig(master_port=port, timeout_s=60), [Engine(url)], spec
    )
    sync.connect()
    sync.sync(learner.module, version=0)
    batch = broadcast_from_rank0(asyncio.run(_sample(url, 6)) if rank == 0 else None)
    scored = learner.policy_log_probs(batch)
    untempered = learner.policy_log_probs(batch, temperature=1.0)
    metrics = learner.train_step(batch)
    behaviour = [
        [lp for lp, m in zip(t.behavior_log_probs, t.action_mask, strict=True) if m] for t in batch
    ]
    return behaviour, scored, untempered, metrics["acceptance_rate"]


@pytest.mark.distributed
def test_learner_log_probs_at_temperature_equal_the_engines(tmp_path):
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    from megatron_fr.engine.launcher import ServerLaunchConfig, launch_server

    torch.manual_seed(5)
    model = AutoModelForCausalLM.from_config(CONFIG_MAPPING["qwen3_moe"](**CONFIG))
    model.save_pretrained(tmp_path / "hf")
    run_on_ranks(to_megatron_on_rank, 1, str(tmp_path / "hf"), str(tmp_path / "m"))
    server = launch_server(
        ServerLaunchConfig(
            model_path=str(tmp_path / "hf"), port=free_port(), log_dir=tmp_path, engine="cpu"
        )
    )
    try:
        server.wait_healthy(deadline_s=120)
        per_rank = run_on_ranks(
            score_on_rank, 2, str(tmp_path / "m"), server.url, free_port(), timeout_s=600
        )
    finally:
        server.stop()
    behaviour, scored, untempered, acceptance = per_rank[0]
    assert per_rank[1][1] == scored, "ranks disagree"
    worst = max(
        abs(a - b)
        for t, s in zip(behaviour, scored, strict=True)
        for a, b in zip(t, s, strict=True)
    )
    assert worst <= 1e-5, f"learner vs engine log-probs at T={TEMPERATURE}: max |diff| {worst}"
    off = max(
        abs(a - b)
        for t, s in zip(behaviour, untempered, strict=True)
        for a, b in zip(t, s, strict=True)
    )
    assert off > 0.05, "scoring at temperature 1 should differ visibly"
    assert acceptance == 1.0, "the gate must admit every on-policy trajectory"
