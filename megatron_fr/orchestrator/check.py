"""`megatron-fr train RECIPE --check [overrides]`: everything that can be checked without GPUs,
before a cluster job is spent on it; nothing is started.

    config       the recipe and overrides against the typed schema (already done by loading)
    task         the environment named and its settings (already done by resolve_task)
    model        model.hf_dir: config.json -> the model spec; its tokenizer and chat template;
                 lengths against the model's context
    data         every prompt file: readable, its fields where the recipe says; each prompt
                 rendered with the chat template (generation prompt on) and counted against
                 max_prompt_tokens (games, whose prompt the game prints, are not rendered)
    layout       the parallel layout through the planner: valid for the world size, and the
                 per-GPU memory against --gpu-mem-gb when given

Prints a one-screen summary; raises CheckFailed naming the first problem found.
"""

from __future__ import annotations

from pathlib import Path

from megatron_fr.config.run import RunConfig


class CheckFailed(ValueError):
    """The recipe cannot run; the message names the setting or file and the reason."""


def check_recipe(
    config: RunConfig, world_size: int, gpu_mem_gb: float | None, render: bool = True
) -> str:
    """The summary; CheckFailed on the first problem. render=False skips rendering every
    prompt with the chat template (the quick preflight `train` runs before starting)."""
    lines = [f"task        {config.task.name}"]
    spec = _model(config, lines)
    _data(config, lines, render)
    _layout(config, spec, world_size, gpu_mem_gb, lines)
    b = config.buffer
    learner = config.learner
    lines.append(f"rollouts    B={b.batch_size}, G={b.group_size}, max_lag={b.max_lag}, "
                 f"T={config.rollout.temperature}; {config.steps} steps; estimator "
                 f"{learner.estimator} with the {learner.policy_loss} loss")  # fmt: skip
    return "\n".join(lines)


def _model(config: RunConfig, lines: list[str]):
    from megatron_fr.orchestrator.workload import check_hf_dir

    try:
        hf_dir, spec = check_hf_dir(config)
    except (OSError, ValueError) as error:
        raise CheckFailed(str(error)) from None
    context = spec.max_position_embeddings
    lines.append(f"model       {hf_dir}: {spec.model_type}, {spec.num_layers} layers, hidden "
                 f"{spec.hidden_size}, vocab {spec.vocab_size}, context {context}")  # fmt: skip
    task = config.task
    budget = (task.agent or task.single_turn_agent()).max_episode_tokens
    if budget > context:
        raise CheckFailed(f"task: a row may reach {budget} tokens, over the model's "
                          f"context {context} (max_position_embeddings)")  # fmt: skip
    return spec


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
        raise CheckFailed(f"task.max_prompt_tokens={limit}: every prompt is longer (the "
                          f"first: {length} tokens), so none would be played")  # fmt: skip
    return (f"; first prompt {length} tokens; {dropped} over max_prompt_tokens="
            f"{task.max_prompt_tokens} would be dropped")  # fmt: skip


def _key(what: str) -> str:
    return "train" if what == "train" else "eval_sets." + what.split(" ", 1)[1]


def _micro_batch_fits_a_row(config: RunConfig) -> None:
    """The longest row the task can make fits one micro-batch, as the learner plans them (it
    refuses a longer trajectory when one comes, and ends the run)."""
    from megatron_fr.learner.micro_batches import plan_micro_batches

    row = (config.task.agent or config.task.single_turn_agent()).max_episode_tokens
    p, budget = config.parallel, config.learner.micro_batch_tokens
    sequence_parallel = p.tensor if p.sequence_parallel else 1
    try:
        plan_micro_batches([row], dp_size=1, token_budget=budget,
                           pack=config.learner.pack_sequences, cp_size=p.context,
                           sequence_parallel_size=sequence_parallel)  # fmt: skip
    except ValueError as error:
        raise CheckFailed(f"learner.micro_batch_tokens={budget}: a row may reach {row} tokens "
                          f"(task), and {error}") from None  # fmt: skip


def _layout(config, spec, world_size: int, gpu_mem_gb: float | None, lines) -> None:
    from megatron_fr.launch.plan import LayoutError, plan_layout

    _micro_batch_fits_a_row(config)
    learner = config.learner
    try:
        plan = plan_layout(
            spec, config.parallel, world_size, micro_batch_tokens=learner.micro_batch_tokens,
            params_dtype=learner.params_dtype, gpu_mem_gib=gpu_mem_gb,
            entropies=learner.flash_reinforce.negative_token_fraction < 1,
        )  # fmt: skip
    except (LayoutError, ValueError) as error:
        raise CheckFailed(f"parallel (world size {world_size}): {error}") from None
    p = config.parallel
    peak = plan.peak_bytes(recompute=False) / 2**30
    verdict = "" if gpu_mem_gb is None else (
        f" of {gpu_mem_gb:g} GiB: " + ("fits" if plan.fits(recompute=False) else
                                      "fits with full recompute" if plan.fits(recompute=True)
                                      else "does NOT fit")
    )  # fmt: skip
    params = plan.params_per_gpu / 1e9
    lines.append(f"layout      {world_size} ranks: TP{p.tensor} PP{p.pipeline} CP{p.context} "
                 f"EP{p.expert} ETP{p.effective_expert_tensor} DP{plan.data_parallel}; "
                 f"{params:.2f} B params and {peak:.1f} GiB per GPU{verdict}")  # fmt: skip
    if gpu_mem_gb is not None and not plan.fits(recompute=True):
        raise CheckFailed(f"parallel: the layout needs {peak:.1f} GiB per GPU, more than "
                          f"{gpu_mem_gb:g} GiB even with full recompute")  # fmt: skip
