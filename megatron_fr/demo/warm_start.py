"""Supervised warm start: a tiny HF policy that knows a task but samples some wrong answers.

RL from a random policy on an exact-match task gets reward 0 on nearly every trajectory, and
a zero advantage teaches nothing; so the CPU demos first fit demonstrations of train-split
problems. The demonstrations are noisy on purpose: a share `label_noise` of the targets are
the task's slips (the answer off by 1 or 10), so a model trained on them learns the skill (its
greedy answer is mostly right) and also learns to sample the slips at temperature 1. That is
the position RL fine-tuning of a supervised LLM starts from, and the one where single-sample RL
has a clear, stable signal: turn the sampled slips into the answer the policy already ranks
first. (A warm start stopped early on clean data instead, at ~25% greedy accuracy, sits where
the skill itself is half-learnt, and the arithmetic demo's held-out accuracy did not rise from
it at any learning rate tried.) Only the targets carry loss: the prompts are not imitated.

Any task of the Task protocol below trains here: TextMathTask (demo/text_math.py) or
ToolDemonstrations (demo/tool_demos.py), whose prompts are chat-rendered by the model's
tokenizer (pass it as `tokenizer=`, and it is saved with the model):

    from megatron_fr.demo.config import WarmStartConfig
    from megatron_fr.demo.text_math import build_text_math_task
    from megatron_fr.demo.tiny_models import tiny_chat_model_config
    from megatron_fr.demo.warm_start import warm_start
    with build_text_math_task() as task:
        report = warm_start("runs/warm", task, tiny_chat_model_config(task.tokenizer),
                            WarmStartConfig(), tokenizer=task.tokenizer)

    megatron-fr demo prepare examples/cpu_demo.yaml      (what the demo recipes use)

The result is a save_pretrained directory (safetensors, config.json, generation_config.json,
and the tokenizer files when there is a tokenizer) that the CPU inference engine and the HF ->
megatron converter load as they would a Qwen3-MoE checkpoint. It is written whole or not at
all, with warm_start.json naming the arguments that produced it: the same arguments again reuse
it; different ones retrain and replace it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import random
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch
from pydantic import BaseModel
from tqdm import tqdm

from megatron_fr.demo.arithmetic import Problem, Split
from megatron_fr.demo.config import WarmStartConfig
from megatron_fr.demo.tiny_models import build_model
from megatron_fr.utils.atomic_dir import atomic_directory
from megatron_fr.utils.provenance import weights_sha256

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

MARKER = "warm_start.json"


class Task(Protocol):
    """What the warm start trains on: problems whose prompts are token ids, the ids of a
    right answer and of a slip, and a reward for generated ids."""

    # Read-only (properties), so a task may hold a narrower type: its own config class.
    @property
    def name(self) -> str: ...

    @property
    def config(self) -> BaseModel: ...

    @property
    def pad_id(self) -> int: ...

    @property
    def stop_token_ids(self) -> tuple[int, ...]: ...

    @property
    def max_new_tokens(self) -> int: ...

    def problems(self, split: Split, count: int, seed: int | None = None) -> list[Problem]: ...

    def target_ids(self, problem: Problem) -> list[int]: ...

    def slip_target_ids(self, problem: Problem, rng: random.Random) -> list[int]: ...

    def reward(self, problem: Problem, output_ids: list[int]) -> float: ...


@dataclass(frozen=True, kw_only=True)
class WarmStartReport:
    initial_loss: float
    """Mean target-token cross-entropy of the first step's batch."""
    final_loss: float
    """Mean over the last tenth of the steps run (one batch is too noisy to compare)."""
    steps_run: int
    greedy_accuracy: float
    """Mean reward of greedy decoding on the held-out problems."""
    sampled_reward: float
    """Mean reward of one temperature-1 sample per held-out problem: where RL starts."""
    eval_problems: int
    seconds: float
    """Wall time of training and evaluation (when reused: that of the run that wrote it)."""
    cpu_seconds: float | None = None
    """CPU time of this process over the same span (all its threads): on a shared machine
    it moves less with the other processes' load than the wall time does."""
    reused: bool = False
    """True when an existing directory with the same arguments was returned untouched."""
    model_sha256: str | None = None
    """sha256 of the saved weights (utils/provenance.py; None in records written before it
    was kept): the model a run or a results table started from."""


def warm_start(
    out_dir: str | Path,
    task: Task,
    model_config: dict,
    config: WarmStartConfig | None = None,
    *,
    tokenizer: PreTrainedTokenizerBase | None = None,
    progress: bool = True,
) -> WarmStartReport:
    """Train (or reuse) the warm-start policy in `out_dir` and say how good it is.

    `tokenizer`: the one the task's ids come from, saved with the model (and part of what
    decides reuse).
    """
    config = config or WarmStartConfig()
    out_dir = Path(out_dir)
    identity = _normalised(
        dict(
            task=task.name,
            task_config=task.config.model_dump(mode="json"),
            model_config=model_config,
            tokenizer=_fingerprint(tokenizer),
            **config.model_dump(mode="json"),
        )
    )
    stored = _stored(out_dir)
    if stored is not None and stored["identity"] == identity:
        return dataclasses.replace(WarmStartReport(**stored["report"]), reused=True)

    start, cpu_start = time.perf_counter(), time.process_time()
    with torch_threads(config.threads), torch.random.fork_rng():  # the caller's left alone
        torch.manual_seed(config.seed)
        model = build_model(model_config, task.stop_token_ids)
        losses = train(model, task, config, progress=progress)
        held_out = task.problems("eval", config.eval_problems)
        greedy = mean_reward(model, task, held_out, temperature=0.0)
        sampled = mean_reward(model, task, held_out, temperature=1.0, seed=config.seed)
    tail = losses[-max(1, len(losses) // 10) :]
    report = WarmStartReport(
        initial_loss=losses[0],
        final_loss=sum(tail) / len(tail),
        steps_run=len(losses),
        greedy_accuracy=greedy,
        sampled_reward=sampled,
        eval_problems=len(held_out),
        seconds=time.perf_counter() - start,
        cpu_seconds=time.process_time() - cpu_start,
    )
    if stored is not None:  # a warm start for other arguments: replaced only now it is stale
        shutil.rmtree(out_dir)
    with atomic_directory(out_dir) as partial:
        model.save_pretrained(partial)
        if tokenizer is not None:
            tokenizer.save_pretrained(partial)
        report = dataclasses.replace(report, model_sha256=weights_sha256(partial))
        record = dict(identity=identity, report=dataclasses.asdict(report))
        (partial / MARKER).write_text(json.dumps(record, indent=2) + "\n")
    return report


@contextlib.contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """torch's intra-op threads set to `count` for the block, the caller's count after."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _fingerprint(tokenizer: PreTrainedTokenizerBase | None) -> str | None:
    """A digest of the tokenizer's vocabulary, merges and chat template."""
    if tokenizer is None:
        return None
    text = tokenizer.backend_tokenizer.to_str() + (tokenizer.chat_template or "")
    return hashlib.sha256(text.encode()).hexdigest()


def train(
    model: torch.nn.Module, task: Task, config: WarmStartConfig, *, progress: bool = True
) -> list[float]:
    """AdamW on target-token cross-entropy, linear warmup then cosine decay to lr/10 over
    `config.steps`; returns each step's mean loss.

    Batches are consecutive slices of one seeded stream of train-split problems (the held-out
    split is never looked at), and each target is independently, with probability
    `label_noise`, the task's slip instead of the answer, from a generator seeded by `seed`:
    the run is a function of its arguments.
    """
    steps, batch_size, seed = config.steps, config.batch_size, config.seed
    problems = task.problems("train", steps * batch_size, seed=seed)
    noise = random.Random(f"label noise/{seed}")
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=config.lr, betas=(0.9, 0.95), weight_decay=0.0
    )
    schedule = _warmup_cosine(optimizer, steps)
    losses = []
    bar = tqdm(range(steps), desc="warm start", file=sys.stderr, disable=not progress)
    for step in bar:
        batch = problems[step * batch_size : (step + 1) * batch_size]
        targets = [
            task.slip_target_ids(problem, noise)
            if noise.random() < config.label_noise
            else task.target_ids(problem)
            for problem in batch
        ]
        losses.append(_step(model, optimizer, *_batch(task, batch, targets)))
        schedule.step()
        bar.set_postfix(loss=f"{losses[-1]:.3f}", refresh=False)
    bar.close()
    return losses


def _warmup_cosine(
    optimizer: torch.optim.Optimizer, steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    warmup = max(1, steps // 20)
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: (
            min(1.0, (step + 1) / warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * step / steps)))
        ),
    )


def _step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    tokens: torch.Tensor,
    loss_mask: torch.Tensor,
) -> float:
    """One optimizer step on the mean cross-entropy of the masked next-token predictions."""
    model.train()
    logits = model(input_ids=tokens[:, :-1]).logits
    token_loss = torch.nn.functional.cross_entropy(
        logits.transpose(1, 2), tokens[:, 1:], reduction="none"
    )
    loss = (token_loss * loss_mask).sum() / loss_mask.sum()
    optimizer.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return loss.item()


def _batch(
    task: Task, problems: list[Problem], targets: list[list[int]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompt + target rows, right-padded ([B, L] ids), and the mask over PREDICTED positions
    ([B, L-1]): True where the next token is part of the target. Padding sits after every
    real token, so under causal attention it changes nothing the loss sees."""
    rows = [
        [*problem.prompt_ids, *target] for problem, target in zip(problems, targets, strict=True)
    ]
    length = max(map(len, rows))
    tokens = torch.full((len(rows), length), task.pad_id, dtype=torch.long)
    loss_mask = torch.zeros(len(rows), length - 1)
    for i, (problem, row) in enumerate(zip(problems, rows, strict=True)):
        tokens[i, : len(row)] = torch.tensor(row)
        loss_mask[i, len(problem.prompt_ids) - 1 : len(row) - 1] = 1.0
    return tokens, loss_mask


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    task: Task,
    problems: list[Problem],
    *,
    temperature: float,
    seed: int = 0,
) -> list[list[int]]:
    """Up to task.max_new_tokens ids per problem, cut after the first stop token.

    temperature 0 is greedy. Prompts of equal length form one batch, so no padding (and no
    attention mask or position offsets) enters the forward; the models are small enough that
    recomputing the prefix at every step costs less than managing a cache.
    """
    model.eval()
    generator = torch.Generator().manual_seed(seed)
    outputs: dict[int, list[int]] = {}
    by_length: dict[int, list[int]] = {}
    for index, problem in enumerate(problems):
        by_length.setdefault(len(problem.prompt_ids), []).append(index)
    for indices in by_length.values():
        tokens = torch.tensor([problems[i].prompt_ids for i in indices])
        prompt_length = tokens.shape[1]
        for _ in range(task.max_new_tokens):
            logits = model(input_ids=tokens).logits[:, -1].double()
            if temperature == 0:
                choice = logits.argmax(-1, keepdim=True)
            else:
                probs = torch.softmax(logits / temperature, -1)
                choice = torch.multinomial(probs, 1, generator=generator)
            tokens = torch.cat([tokens, choice], dim=1)
        for i, row in zip(indices, tokens[:, prompt_length:].tolist(), strict=True):
            stops = [at for at, token in enumerate(row) if token in task.stop_token_ids]
            outputs[i] = row[: stops[0] + 1] if stops else row
    return [outputs[i] for i in range(len(problems))]


def mean_reward(
    model: torch.nn.Module,
    task: Task,
    problems: list[Problem],
    *,
    temperature: float,
    seed: int = 0,
) -> float:
    """The task's mean reward over one generation per problem."""
    if not problems:
        raise ValueError("mean_reward needs at least one problem")
    outputs = generate(model, task, problems, temperature=temperature, seed=seed)
    rewards = [task.reward(p, out) for p, out in zip(problems, outputs, strict=True)]
    return sum(rewards) / len(rewards)


def _stored(out_dir: Path) -> dict | None:
    """The warm_start.json record in `out_dir`; None if there is no directory. A directory
    without the record was not written here and is never replaced."""
    if not out_dir.exists():
        return None
    marker = out_dir / MARKER
    if not marker.is_file():
        raise FileExistsError(
            f"{out_dir} exists but holds no {MARKER}, so it is not a warm start this code wrote; "
            "remove it or choose another output directory"
        )
    return json.loads(marker.read_text())


def _normalised(value: dict) -> dict:
    """As it reads back from JSON (tuples become lists), so a stored identity compares equal."""
    return json.loads(json.dumps(value, sort_keys=True))
