"""A recipe's workload: the model directory a run starts from and how its episodes are played.

task.name ─► the environment (envs/registry.py) ─► its settings validated (task.env) and
             its multi-turn defaults (task.agent) filled in: resolve_task, before any
             process starts, so the run directory's config.yaml shows what ran
prompt files ─► samples whose rendered prompt fits max_prompt_tokens
─► AgentEpisodes: each problem played through the agent loop with the model's own chat
   template (one turn for single-turn environments such as math)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from megatron_fr.config.data import DatasetConfig
from megatron_fr.config.run import RunConfig
from megatron_fr.envs.base import Environment, Sample
from megatron_fr.envs.registry import build_environment, environment_class, environment_config
from megatron_fr.models.hf_config import HFModelSpec

if TYPE_CHECKING:
    from megatron_fr.rollout.chat import ChatFormat
    from megatron_fr.rollout.episodes import EpisodeProducer


def resolve_task(config: RunConfig) -> RunConfig:
    """The config with task.env validated by the environment's Config (written back in full)
    and task.agent set: the recipe's, else the environment's defaults, else one turn.
    ValueError naming the key for an unknown environment or a bad setting."""
    task = config.task
    environment = environment_class(task.name)
    settings = environment_config(task.name, task.env).model_dump(mode="json")
    agent = task.agent or environment.agent or task.single_turn_agent()
    resolved = task.model_copy(update={"env": settings, "agent": agent})
    return config.model_copy(update={"task": resolved})


def check_hf_dir(config: RunConfig) -> tuple[Path, HFModelSpec]:
    """model.hf_dir's directory and model: a config.json a model can be built from, and a
    tokenizer with a chat template whose ids the model's vocabulary holds. FileNotFoundError
    without a config.json, ValueError naming the file and the field for anything else."""
    from megatron_fr.models.hf_config import spec_from_dict
    from megatron_fr.rollout.chat import load_chat

    hf_dir = Path(config.model.hf_dir)
    file = hf_dir / "config.json"
    if not file.is_file():
        hint = (
            " (the CPU demos' models are made by `megatron-fr demo prepare RECIPE`)"
            if not hf_dir.exists()
            else ""
        )
        raise FileNotFoundError(f"model.hf_dir {hf_dir}: no config.json there{hint}")
    try:
        spec = spec_from_dict(json.loads(file.read_text()))
    except (OSError, ValueError) as error:
        raise ValueError(f"model.hf_dir {file}: {error}") from None
    try:
        tokenizer = load_chat(hf_dir).tokenizer
    except Exception as error:  # tokenizer libraries raise types of their own on broken files
        raise ValueError(
            f"model.hf_dir {hf_dir}: no usable tokenizer with a chat template ({error})"
        ) from None
    if len(tokenizer) > spec.vocab_size:
        raise ValueError(
            f"model.hf_dir {file}: vocab_size {spec.vocab_size} is smaller than "
            f"the tokenizer's {len(tokenizer)} tokens"
        )
    return hf_dir, spec


def build_producer(config: RunConfig, hf_dir: Path) -> EpisodeProducer:
    """What the run's problems are and how an episode is played (config from resolve_task)."""
    # here, not at the top: checking a recipe (train --check, the launching parent) builds
    # no producer, and the episodes' modules import torch
    from megatron_fr.rollout.chat import load_chat
    from megatron_fr.rollout.episodes import AgentEpisodes, TruncationHandling

    task = config.task
    agent = task.agent or task.single_turn_agent()
    chat = load_chat(hf_dir)
    environment = build_environment(task.name, task.env)
    fits_context(hf_dir, agent.max_episode_tokens)
    train = _samples(task.train, environment, chat, task.max_prompt_tokens, "train")
    evals = {
        name: _samples(spec, environment, chat, task.max_prompt_tokens, f"eval {name}")
        for name, spec in task.eval_sets.items()
    }
    budget = task.max_new_tokens if agent.max_turns == 1 else agent.max_episode_tokens
    handling = TruncationHandling(
        task.truncated, budget, task.overlong_buffer_tokens, task.overlong_penalty
    )
    return AgentEpisodes(
        chat=chat,
        environment=environment,
        agent=agent,
        train=train,
        eval_sets=evals,
        max_new_tokens=task.max_new_tokens,
        handling=handling,
    )


def fits_context(hf_dir: Path, row_tokens: int) -> None:
    """An episode's row must fit the model's context: the engines refuse longer requests."""
    context = json.loads((hf_dir / "config.json").read_text()).get("max_position_embeddings")
    if context is not None and row_tokens > context:
        raise ValueError(
            f"task: episodes may reach {row_tokens} tokens, over the model's "
            f"context {context} (max_position_embeddings of {hf_dir})"
        )


def _samples(
    spec: DatasetConfig,
    environment: Environment,
    chat: ChatFormat,
    max_prompt_tokens: int,
    what: str,
) -> list[Sample]:
    """A prompt file's samples whose rendered prompt fits max_prompt_tokens (the others are
    dropped and counted in the log)."""
    from megatron_fr.envs.datasets import load_dataset
    from megatron_fr.rollout.chat import filter_by_prompt_length

    kept, dropped = filter_by_prompt_length(
        load_dataset(spec), environment, chat, max_prompt_tokens
    )
    print(
        f"{what}: {len(kept)} prompts from {spec.path} ({dropped} dropped: longer than "
        f"max_prompt_tokens={max_prompt_tokens})",
        flush=True,
    )
    if not kept:
        raise ValueError(f"{what}: no prompt of {spec.path} fits max_prompt_tokens")
    return kept
