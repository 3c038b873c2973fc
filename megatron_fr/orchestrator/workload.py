"""A recipe's workload: the model a run starts from and how its episodes are played.

    task arithmetic         token ids end to end (tasks/arithmetic.py): TokenTaskEpisodes
    task math               prompt files -> the math environment, one turn        \\
    task python_tool        prompt files -> the Python sandbox, multi-turn         |  AgentEpisodes
    task alfworld/textworld game specs -> the ALFWorld/TextWorld engine, multi-turn /

Without model.hf_dir the run makes a tiny model for its task in RUN_DIR/warm_start: the
arithmetic and math tasks warm-start it on noisy demonstrations (config/warm_start.py);
python_tool on two-turn tool demonstrations when its samples carry a reference program; the
game tasks get a randomly initialised one whose tokenizer is trained on the task's text (the
CPU twins check the plumbing, not the skill).
"""

from __future__ import annotations

import logging
from pathlib import Path

from megatron_fr.config.run import RunConfig
from megatron_fr.config.tasks import AgentConfig, ArithmeticTask, MathTask
from megatron_fr.envs.base import Sample
from megatron_fr.rollout.episodes import (
    AgentEpisodes,
    EpisodeProducer,
    TokenTaskEpisodes,
    TruncationHandling,
)

log = logging.getLogger("megatron_fr.workload")

ENVIRONMENT_OF = {"math": "math", "python_tool": "python_tool", "alfworld": "alfworld",
                  "textworld": "alfworld"}  # fmt: skip
"""TextWorld games are played through the ALFWorld environment (its engine is TextWorld's)."""


def prepare_hf_model(config: RunConfig, run_dir: Path) -> Path:
    """The HF directory the engines serve first and the learners load: model.hf_dir, or the
    task's tiny model made in run_dir/warm_start (reused when made with the same settings).
    One process, before or without the learner ranks."""
    if config.model.hf_dir:
        return check_hf_dir(config)
    hf_dir = run_dir / "warm_start"
    task = config.task
    if isinstance(task, ArithmeticTask):
        from megatron_fr.learner.warm_start import warm_start
        from megatron_fr.tasks import build_task
        from megatron_fr.tasks.arithmetic import tiny_model_config

        report = warm_start(hf_dir, build_task(task), tiny_model_config(), config.model.warm_start)
    elif isinstance(task, MathTask):
        report = _warm_start_text_math(config, hf_dir)
    else:
        report = _agent_model(config, hf_dir)
    print(f"warm start: {report}", flush=True)
    return hf_dir


def check_hf_dir(config: RunConfig) -> Path:
    """model.hf_dir has a config.json, and for a text task its tokenizer and chat template."""
    hf_dir = Path(config.model.hf_dir)
    if not (hf_dir / "config.json").is_file():
        raise FileNotFoundError(f"model.hf_dir {hf_dir}: no config.json there")
    if not isinstance(config.task, ArithmeticTask):
        from megatron_fr.tasks.chat import load_chat

        try:
            load_chat(hf_dir)
        except (OSError, ValueError) as error:
            raise FileNotFoundError(
                f"model.hf_dir {hf_dir}: no usable tokenizer with a chat template ({error})"
            ) from None
    return hf_dir


def _warm_start_text_math(config: RunConfig, hf_dir: Path):
    from megatron_fr.learner.warm_start import warm_start
    from megatron_fr.tasks.text_math import TextMathConfig, build_text_math_task
    from megatron_fr.tasks.tiny_models import tiny_chat_model_config

    settings = config.model.warm_start
    text = TextMathConfig(problems=settings.problems, environment=config.task.env)
    with build_text_math_task(text) as task:
        return warm_start(hf_dir, task, tiny_chat_model_config(task.tokenizer), settings,
                          tokenizer=task.tokenizer)  # fmt: skip


def _agent_model(config: RunConfig, hf_dir: Path):
    """The agent tasks' tiny chat model: a tokenizer trained on the task's text; for
    python_tool samples with a reference program, warm-started on two-turn demonstrations
    (tasks/tool_demos.py), so that its episodes call the tool and get graded; otherwise
    randomly initialised."""
    from megatron_fr.envs.datasets import load_dataset
    from megatron_fr.tasks.chat_tokenizer import build_chat_tokenizer
    from megatron_fr.tasks.tool_demos import answer_text, tool_call_text

    samples = load_dataset(config.task.train)
    system = getattr(config.task.env, "system_prompt", None) or ""
    chats = [[{"role": "system", "content": system},
              {"role": "user", "content": str(sample.get("problem", sample))},
              *([{"role": "assistant", "content": tool_call_text(sample["code"])},
                 {"role": "assistant", "content": answer_text(str(sample["answer"]))}]
                if "code" in sample else [])]
             for sample in samples]  # fmt: skip
    tokenizer = build_chat_tokenizer(chats, vocab_size=512)
    if config.task.name == "python_tool" and all("code" in s for s in samples):
        return _warm_start_tool_demos(config, hf_dir, samples, tokenizer)
    if (hf_dir / "config.json").is_file():
        return f"reused {hf_dir}"
    import torch

    from megatron_fr.tasks.tiny_models import (
        build_model,
        chat_stop_token_ids,
        save_chat_model,
        tiny_chat_model_config,
    )

    with torch.random.fork_rng():
        torch.manual_seed(config.model.warm_start.seed)
        model = build_model(tiny_chat_model_config(tokenizer), chat_stop_token_ids(tokenizer))
    save_chat_model(hf_dir, model, tokenizer)
    return f"a randomly initialised tiny chat model in {hf_dir}"


def _warm_start_tool_demos(config: RunConfig, hf_dir: Path, samples, tokenizer):
    from megatron_fr.learner.warm_start import warm_start
    from megatron_fr.tasks.tiny_models import tiny_chat_model_config
    from megatron_fr.tasks.tool_demos import ToolDemonstrations

    task = ToolDemonstrations(samples, config.task.env, tokenizer)
    try:
        return warm_start(hf_dir, task, tiny_chat_model_config(tokenizer),
                          config.model.warm_start, tokenizer=tokenizer)  # fmt: skip
    finally:
        task.close()


def build_producer(config: RunConfig, hf_dir: Path) -> EpisodeProducer:
    """What the run's problems are and how an episode is played."""
    task = config.task
    if isinstance(task, ArithmeticTask):
        from megatron_fr.tasks import build_task

        token_task = build_task(task)
        return TokenTaskEpisodes(token_task, train_size=token_task.split_size("train"),
                                 eval_size=config.eval.problems, seed=config.seed)  # fmt: skip
    from megatron_fr.envs.registry import build_environment
    from megatron_fr.tasks.chat import load_chat

    chat = load_chat(hf_dir)
    environment = build_environment(ENVIRONMENT_OF[task.name], task.env.model_dump())
    agent = getattr(task, "agent", None) or AgentConfig(
        max_turns=1, max_new_tokens_per_turn=task.max_new_tokens,
        max_episode_tokens=task.max_prompt_tokens + task.max_new_tokens,
    )  # fmt: skip
    _fits_context(hf_dir, agent.max_episode_tokens)
    train = _samples(task.train, environment, chat, task.max_prompt_tokens, "train")
    evals = {name: _samples(spec, environment, chat, task.max_prompt_tokens, f"eval {name}")
             for name, spec in task.eval_sets.items()}  # fmt: skip
    budget = task.max_new_tokens if agent.max_turns == 1 else agent.max_episode_tokens
    handling = TruncationHandling(task.truncated, budget, task.overlong_buffer_tokens,
                                  task.overlong_penalty)  # fmt: skip
    return AgentEpisodes(chat=chat, environment=environment, agent=agent, train=train,
                         eval_sets=evals, max_new_tokens=task.max_new_tokens,
                         handling=handling)  # fmt: skip


def _fits_context(hf_dir: Path, row_tokens: int) -> None:
    """An episode's row must fit the model's context: the engines refuse longer requests."""
    import json

    context = json.loads((hf_dir / "config.json").read_text()).get("max_position_embeddings")
    if context is not None and row_tokens > context:
        raise ValueError(f"task: episodes may reach {row_tokens} tokens, over the model's "
                         f"context {context} (max_position_embeddings of {hf_dir})")  # fmt: skip


def _samples(spec, environment, chat, max_prompt_tokens: int, what: str) -> list[Sample]:
    """A prompt file's samples whose rendered prompt fits max_prompt_tokens (the others are
    dropped and counted in the log)."""
    from megatron_fr.envs.datasets import filter_by_prompt_length, load_dataset

    kept, dropped = filter_by_prompt_length(
        load_dataset(spec), environment, chat, max_prompt_tokens
    )
    print(f"{what}: {len(kept)} prompts from {spec.path} ({dropped} dropped: longer than "
          f"max_prompt_tokens={max_prompt_tokens})", flush=True)  # fmt: skip
    if not kept:
        raise ValueError(f"{what}: no prompt of {spec.path} fits max_prompt_tokens")
    return kept
