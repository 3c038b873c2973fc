"""Make a demo recipe's starting model: a tiny chat model in the recipe's model.hf_dir.

    math          a tokenizer trained on the arithmetic chats, a model warm-started on noisy
                  demonstrations of the problems (demo/text_math.py)
    python_tool   a tokenizer trained on the task's text; warm-started on two-turn tool
                  demonstrations when every training sample carries a reference program
                  (demo/tool_demos.py)
    others        a tokenizer trained on the task's text and a randomly initialised model

A model made with the same settings is reused; the directory is written whole or not at all.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from pydantic import BaseModel

from megatron_fr.config.run import RunConfig
from megatron_fr.demo.config import DemoModelConfig, WarmStartConfig
from megatron_fr.envs.base import Sample
from megatron_fr.envs.datasets import load_dataset
from megatron_fr.envs.registry import environment_config

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

    from megatron_fr.demo.warm_start import WarmStartReport

EnvConfig = TypeVar("EnvConfig", bound=BaseModel)


def prepare_model(config: RunConfig, demo: DemoModelConfig) -> str:
    """Write (or reuse) the model of `config.model.hf_dir`; what was made, in plain words."""
    hf_dir = Path(config.model.hf_dir)
    task = config.task
    if task.name == "math":
        return describe_warm_start(_warm_start_text_math(config, demo, hf_dir), hf_dir)
    samples = load_dataset(task.train)
    tokenizer = _task_tokenizer(config, demo, samples)
    tool_demos = task.name == "python_tool" and all("code" in sample for sample in samples)
    if demo.warm_start is not None and tool_demos:
        report = _warm_start_tool_demos(config, demo.warm_start, hf_dir, samples, tokenizer)
        return describe_warm_start(report, hf_dir)
    return _random_model(config, hf_dir, tokenizer)


def describe_warm_start(report: WarmStartReport, hf_dir: Path) -> str:
    """The warm start's report as a user reads it: where the model is, which weights (the
    sha256 a run's config.yaml and a results table name), and how well it starts."""
    made = "reused (made before with the same settings)" if report.reused else "made"
    lines = [f"demo model {made}: {hf_dir}"]
    if report.model_sha256:
        lines.append(f"  weights sha256 {report.model_sha256}")
    lines.append(
        f"  warm start: {report.steps_run} steps, loss {report.initial_loss:.3f} -> "
        f"{report.final_loss:.3f}, {report.seconds:.0f} s"
    )
    lines.append(
        f"  on {report.eval_problems} held-out problems: greedy accuracy "
        f"{report.greedy_accuracy:.3f}, sampled reward {report.sampled_reward:.3f} (where RL "
        "starts)"
    )
    return "\n".join(lines)


def demo_model_config(config: RunConfig, tokenizer: PreTrainedTokenizerBase) -> dict:
    """The demo model's config.json for `tokenizer`: the tiny Qwen3-MoE, or its dense variant
    with wider heads for the engine kinds that want it (vLLM: config/engine_kinds.py
    dense_demo_model; demo/tiny_models.py: dense_variant)."""
    from megatron_fr.config.engine_kinds import capabilities
    from megatron_fr.demo.tiny_models import dense_variant, tiny_chat_model_config

    model = tiny_chat_model_config(tokenizer)
    dense = capabilities(config.rollout.engine.kind).dense_demo_model
    return dense_variant(model) if dense else model


def _env_config(config: RunConfig, name: str, kind: type[EnvConfig]) -> EnvConfig:
    """task.env validated as environment `name`'s settings, which the demo reads as `kind`."""
    settings = environment_config(name, config.task.env)
    if not isinstance(settings, kind):  # `name` resolved to another class than the built-in
        raise TypeError(f"environment {name!r}: its settings are not {kind.__name__}")
    return settings


def _warm_start_text_math(
    config: RunConfig, demo: DemoModelConfig, hf_dir: Path
) -> WarmStartReport:
    from megatron_fr.demo.text_math import TextMathConfig, build_text_math_task
    from megatron_fr.demo.warm_start import warm_start
    from megatron_fr.envs.math_env import MathEnvConfig

    if demo.warm_start is None:
        raise ValueError("demo.warm_start: the math demo needs a warm start")
    environment = _env_config(config, "math", MathEnvConfig)
    text = TextMathConfig(problems=demo.warm_start.problems, environment=environment)
    with build_text_math_task(text, demo.tokenizer_vocab) as task:
        return warm_start(
            hf_dir,
            task,
            demo_model_config(config, task.tokenizer),
            demo.warm_start,
            tokenizer=task.tokenizer,
        )


def _task_tokenizer(
    config: RunConfig, demo: DemoModelConfig, samples: list[Sample]
) -> PreTrainedTokenizerFast:
    """A BPE tokenizer trained on the task's own text: the system prompt, every problem and,
    for samples with a reference program, the tool call and answer a solver would write."""
    from megatron_fr.demo.chat_tokenizer import build_chat_tokenizer
    from megatron_fr.demo.tool_demos import answer_text, tool_call_text

    system = getattr(environment_config(config.task.name, config.task.env), "system_prompt", None)
    chats = [
        [
            {"role": "system", "content": system or ""},
            {"role": "user", "content": str(sample.get("problem", sample))},
            *(
                [
                    {"role": "assistant", "content": tool_call_text(sample["code"])},
                    {"role": "assistant", "content": answer_text(str(sample["answer"]))},
                ]
                if "code" in sample
                else []
            ),
        ]
        for sample in samples
    ]
    return build_chat_tokenizer(chats, vocab_size=demo.tokenizer_vocab)


def _warm_start_tool_demos(
    config: RunConfig,
    warm: WarmStartConfig,
    hf_dir: Path,
    samples: list[Sample],
    tokenizer: PreTrainedTokenizerFast,
) -> WarmStartReport:
    from megatron_fr.demo.tool_demos import ToolDemonstrations
    from megatron_fr.demo.warm_start import warm_start
    from megatron_fr.envs.python_tool import PythonToolConfig

    environment = _env_config(config, "python_tool", PythonToolConfig)
    task = ToolDemonstrations(samples, environment, tokenizer)
    try:
        return warm_start(
            hf_dir, task, demo_model_config(config, tokenizer), warm, tokenizer=tokenizer
        )
    finally:
        task.close()


def _random_model(config: RunConfig, hf_dir: Path, tokenizer: PreTrainedTokenizerFast) -> str:
    import torch

    from megatron_fr.demo.tiny_models import (
        build_model,
        chat_stop_token_ids,
        save_chat_model,
    )

    if (hf_dir / "config.json").is_file():
        return f"demo model reused: {hf_dir}"
    with torch.random.fork_rng():
        torch.manual_seed(config.seed)
        model = build_model(demo_model_config(config, tokenizer), chat_stop_token_ids(tokenizer))
    save_chat_model(hf_dir, model, tokenizer)
    return f"demo model made: {hf_dir} (a randomly initialised tiny chat model)"
