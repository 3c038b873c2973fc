"""How the CPU demos' tiny models are made: the supervised warm start's settings, per environment.

RL fine-tuning starts from a supervised model that has the skill but samples mistakes (a
policy that is right every time leaves nothing to learn, one that never is gives no signal).
On CPU no pretrained model can be downloaded, so the demos warm-start a tiny model on
demonstrations of which a share (`label_noise`) carry plausible slips (the answer off by 1 or
10); demo/warm_start.py trains it. Imports no torch.
"""

from __future__ import annotations

from pydantic import Field, PositiveFloat, PositiveInt

from megatron_fr.config.base import StrictModel
from megatron_fr.demo.arithmetic import ArithmeticConfig


class WarmStartConfig(StrictModel):
    """How the supervised warm start trains and how it is scored."""

    steps: PositiveInt = 1000
    """Optimizer steps (AdamW, linear warmup then cosine decay to lr / 10)."""
    batch_size: PositiveInt = 64
    """Demonstrations per step, drawn from the train split."""
    lr: PositiveFloat = 5e-3
    """Peak learning rate."""
    label_noise: float = Field(default=0.5, ge=0.0, le=1.0)
    """Share of demonstrations whose answer is one of the task's slips instead of the answer."""
    seed: int = 0
    """Seeds the initialisation, the problem stream, the label noise and the sampled eval."""
    threads: PositiveInt = 2
    """torch threads the warm start runs on, whatever the caller's setting: the kernels split
    their sums by thread count, so the same seed on 1 and 2 threads gives other weights
    (compounded over the steps); fixed, the model is the same bits on any machine of a kind."""
    eval_problems: PositiveInt = 200
    """Held-out problems scored after training (always the same: drawn at the task's seed)."""
    problems: ArithmeticConfig = ArithmeticConfig(digits=2, operations=("+",))
    """For a math task: the arithmetic problems, asked in words and answered in \\boxed{},
    the tiny chat model is warm-started on (demo/text_math.py). The recipe's prompt files
    must come from the same settings (`python -m megatron_fr.demo.text_math`), so that the
    held-out set stays unseen. Unused by the token-level arithmetic task."""


class DemoModelConfig(StrictModel):
    """What `megatron-fr demo prepare` makes for a recipe; each field starts from its
    environment's default (DEFAULTS) and is overridden on the command line as demo.KEY=VALUE."""

    warm_start: WarmStartConfig | None = None
    """The supervised warm start; None: a randomly initialised model (it checks the plumbing
    of a recipe, not its skill)."""
    tokenizer_vocab: PositiveInt = 512
    """Size of the BPE vocabulary trained on the task's text (the model pads it to a multiple
    of 64)."""


DEFAULTS: dict[str, DemoModelConfig] = {
    "math": DemoModelConfig(warm_start=WarmStartConfig(), tokenizer_vocab=384),
    "python_tool": DemoModelConfig(
        warm_start=WarmStartConfig(steps=150, batch_size=16, label_noise=0.2, eval_problems=20)
    ),
}
"""Measured per environment: math, the text demo's warm start (1,000 steps of 64 noisy
demonstrations: greedy accuracy 1.0, temperature-1 accuracy about 0.5 on held-out problems);
python_tool, two-turn tool demonstrations of the bundled problems, so that episodes call the
tool and get graded. Other environments get a randomly initialised model."""


QUICK_DEMO_MODEL = (
    "demo.warm_start.steps=150",
    "demo.warm_start.batch_size=32",
    "demo.warm_start.eval_problems=50",
    "demo.warm_start.problems={digits: 1}",
)
"""`demo prepare` overrides for a demo model made in under a minute on an idle 2-core machine:
warm-started on one-digit sums, it answers in the task's format and gets about one in five
right at temperature 1 (sampled_reward 0.18 when measured), so rewards vary within a batch.
The test suite's runs and tools/bench_startup.py use it."""
