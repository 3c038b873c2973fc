"""`megatron-fr train RECIPE --check [overrides]`: everything that can be checked without GPUs,
before a cluster job is spent on it; nothing is started.

    config       the recipe and overrides against the typed schema (already done by loading)
    task         the environment named and its settings (already done by resolve_task)
    model        model.hf_dir: config.json -> the model spec; its tokenizer and chat template;
                 lengths against the model's context
    rows         the task's longest row against what a micro-batch holds (config/learner.py's
                 longest_row: the learner's own rule)
    data         every prompt file: readable, its fields where the recipe says; each prompt
                 rendered with the chat template (generation prompt on) and counted against
                 max_prompt_tokens (games, whose prompt the game prints, are not rendered)
    layout       the parallel layout through the planner: valid for the world size, and the
                 per-GPU memory against --gpu-mem-gb when given, with learner.recompute

Prints a one-screen summary; raises CheckFailed naming the first problem found.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from megatron_fr.config.run import RunConfig
from megatron_fr.config.tasks import TaskConfig

if TYPE_CHECKING:
    from megatron_fr.models.hf_config import HFModelSpec


class CheckFailed(ValueError):
    """The recipe cannot run; the message names the setting or file and the reason."""


def check_recipe(
    config: RunConfig, world_size: int, gpu_mem_gb: float | None, render: bool = True
) -> str:
    """The summary; CheckFailed on the first problem. render=False skips rendering every
    prompt with the chat template (the quick preflight `train` runs before starting)."""
    lines = [f"task        {config.task.name}"]
    _rows(config, lines)  # the recipe alone decides it: before any file is read
    spec = _model(config, lines)
    _data(config, lines, render)
    _layout(config, spec, world_size, gpu_mem_gb, lines)
    b = config.buffer
    learner = config.learner
    lines.append(
        f"rollouts    B={b.batch_size}, G={b.group_size}, max_lag={b.max_lag}, "
        f"T={config.rollout.temperature}; {config.steps} steps; estimator "
        f"{learner.estimator} with the {learner.policy_loss} loss"
    )
    return "\n".join(lines)


def _model(config: RunConfig, lines: list[str]) -> HFModelSpec:
    from megatron_fr.orchestrator.workload import check_hf_dir

    try:
        hf_dir, spec = check_hf_dir(config)
    except (OSError, ValueError) as error:
        raise CheckFailed(str(error)) from None
    context = spec.max_position_embeddings
    lines.append(
        f"model       {hf_dir}: {spec.model_type}, {spec.num_layers} layers, hidden "
        f"{spec.hidden_size}, vocab {spec.vocab_size}, context {context}"
    )
    _weight_readback(config, spec)
    budget, _ = _row_tokens(config.task)
    if budget > context:
        raise CheckFailed(
            f"task: a row may reach {budget} tokens, over the model's "
            f"context {context} (max_position_embeddings)"
        )
    return spec


def _weight_readback(config: RunConfig, spec: HFModelSpec) -> None:
    """weights.spot_check reads weights back, which SGLang's /get_weights_by_name does for a
    few model families only and vLLM not at all: refused here for the engines the run starts,
    not at the first sync minutes later (engines given by URL are told apart only when they
    answer, and the sync refuses them then)."""
    from megatron_fr.engine.backends import backend_for

    engine = config.rollout.engine
    refusal = backend_for(engine.kind).readback_refusal(spec.model_type)
    if engine.started and config.weights.spot_check and refusal:
        raise CheckFailed(
            f"weights.spot_check {config.weights.spot_check}: {refusal}: set "
            "weights.spot_check=0 (the sync check, weights.verify_every, checks the engines by "
            "their log-probs)"
        )


def _row_tokens(task: TaskConfig) -> tuple[int, str]:
    """The longest row the task can make, and the keys it comes from."""
    agent = task.agent
    if agent is not None and agent.max_turns > 1:
        return agent.max_episode_tokens, f"task.agent.max_episode_tokens {agent.max_episode_tokens}"
    return task.max_prompt_tokens + task.max_new_tokens, (
        f"task.max_prompt_tokens {task.max_prompt_tokens} + task.max_new_tokens "
        f"{task.max_new_tokens}"
    )


def _rows(config: RunConfig, lines: list[str]) -> None:
    from megatron_fr.config.learner import longest_row, micro_batch_tokens_for

    row, source = _row_tokens(config.task)
    p, tokens = config.parallel, config.learner.micro_batch_tokens
    sp = p.tensor if p.sequence_parallel else 1
    longest = longest_row(tokens, p.context, sp)
    if row > longest:
        raise CheckFailed(
            f"learner.micro_batch_tokens: rows reach {row} tokens ({source}), but a micro-batch "
            f"of learner.micro_batch_tokens {tokens} x parallel.context {p.context} holds "
            f"rows of at most {longest}; set learner.micro_batch_tokens >= "
            f"{micro_batch_tokens_for(row, p.context, sp)} (or raise parallel.context)"
        )
    lines.append(
        f"rows        up to {row} tokens; a micro-batch holds {longest} "
        f"({tokens} tokens per GPU x CP{p.context})"
    )


def _data(config: RunConfig, lines: list[str], render: bool) -> None:
    from megatron_fr.envs.datasets import load_dataset

    task = config.task
    files = {"train": task.train, **{f"eval {n}": s for n, s in task.eval_sets.items()}}
    for what, spec in files.items():
        if not Path(spec.path).is_file():
            raise CheckFailed(f"task.{_key(what)}.path: {spec.path} does not exist")
        try:
            samples = load_dataset(spec)
        except (ValueError, KeyError, OSError) as error:
            raise CheckFailed(f"task.{_key(what)}: {error}") from None
        rendered = _rendered(config, samples) if render else ""
        lines.append(f"data        {what}: {len(samples)} rows in {spec.path}{rendered}")


def _rendered(config: RunConfig, samples: list) -> str:
    """How the prompts render with the model's chat template, when there is a model and the
    rows carry prompts."""
    task = config.task
    if task.train.prompt_key is None:
        return ""
    from megatron_fr.envs.registry import build_environment
    from megatron_fr.rollout.chat import filter_by_prompt_length, load_chat

    chat = load_chat(config.model.hf_dir)
    with build_environment(task.name, task.env) as environment:
        _, dropped = filter_by_prompt_length(samples, environment, chat, task.max_prompt_tokens)
        episode = environment.start(samples[0])
        length = len(chat.prompt_ids(episode.messages, episode.tools))
        episode.close()
    if dropped == len(samples):
        limit = task.max_prompt_tokens
        raise CheckFailed(
            f"task.max_prompt_tokens={limit}: every prompt is longer (the "
            f"first: {length} tokens), so none would be played"
        )
    return (
        f"; first prompt {length} tokens; {dropped} over max_prompt_tokens="
        f"{task.max_prompt_tokens} would be dropped"
    )


def _key(what: str) -> str:
    return "train" if what == "train" else "eval_sets." + what.split(" ", 1)[1]


def _layout(
    config: RunConfig,
    spec: HFModelSpec,
    world_size: int,
    gpu_mem_gb: float | None,
    lines: list[str],
) -> None:
    from megatron_fr.launch.plan import LayoutError, plan_layout

    learner = config.learner
    rows = _row_tokens(config.task)[0]
    try:
        plan = plan_layout(
            spec,
            config.parallel,
            world_size,
            micro_batch_tokens=learner.micro_batch_tokens,
            params_dtype=learner.params_dtype,
            gpu_mem_gib=gpu_mem_gb,
            entropies=learner.flash_reinforce.negative_token_fraction < 1,
            row_tokens=rows,
            sync_bucket_bytes=config.weights.bucket_mib * 2**20,
            sync_overlap=config.weights.overlap,
        )
    except (LayoutError, ValueError) as error:
        raise CheckFailed(f"parallel (world size {world_size}): {error}") from None
    p, recompute = config.parallel, learner.recompute
    peak = plan.peak_bytes(recompute) / 2**30
    fits = plan.fits(recompute)
    verdict = (
        "" if fits is None else f" of {gpu_mem_gb:g} GiB: " + ("fits" if fits else "does NOT fit")
    )
    params = plan.params_per_gpu / 1e9
    lines.append(
        f"layout      {world_size} ranks: TP{p.tensor} PP{p.pipeline} CP{p.context} "
        f"EP{p.expert} ETP{p.effective_expert_tensor} DP{plan.data_parallel}; "
        f"{params:.2f} B params and {peak:.1f} GiB per GPU with learner.recompute "
        f"{recompute}{verdict}"
    )
    if fits is False:
        least = plan.least_recompute()
        remedy = f"set learner.recompute={least}" if least else "no recompute setting fits"
        raise CheckFailed(
            f"learner.recompute: with {recompute} the layout needs {peak:.1f} GiB "
            f"per GPU, more than {gpu_mem_gb:g} GiB; {remedy}"
        )
