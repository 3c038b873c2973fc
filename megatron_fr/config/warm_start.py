"""The supervised warm start of a recipe without a starting checkpoint (the CPU demos).

RL fine-tuning starts from a supervised model that has the skill but samples mistakes (a
policy that is right every time leaves nothing to learn, one that never is gives no signal).
On CPU no pretrained model can be downloaded, so the demos warm-start a tiny model on
demonstrations of which a share (`label_noise`) carry plausible slips (the answer off by 1 or
10); learner/warm_start.py trains it. Imports no torch.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, PositiveInt

from megatron_fr.tasks.arithmetic import ArithmeticConfig


class WarmStartConfig(BaseModel):
    """How the supervised warm start trains and how it is scored."""

    model_config = ConfigDict(extra="forbid", frozen=True)

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
    eval_problems: PositiveInt = 200
    """Held-out problems scored after training (always the same: drawn at the task's seed)."""
    problems: ArithmeticConfig = ArithmeticConfig(digits=2, operations=("+",))
    """For a math task: the arithmetic problems, asked in words and answered in \\boxed{},
    the tiny chat model is warm-started on (tasks/text_math.py). The recipe's prompt files
    must come from the same settings (`python -m megatron_fr.tasks.text_math`), so that the
    held-out set stays unseen. Unused by the token-level arithmetic task."""


ARITHMETIC_DEMO = WarmStartConfig(steps=1500, batch_size=128, lr=5e-3, label_noise=0.5)
"""The token-level arithmetic demo's settings (examples/cpu_arithmetic.yaml)."""
