"""A learner step whose loss or gradient is not finite is skipped before the optimizer touches
a weight: the weights, Adam's state and step counts and the LR schedule stay as they were, on
every rank, and the step says why; the next finite step trains as usual."""

from __future__ import annotations

import math

import pytest
import torch
from test_learner import CONFIG, random_batch

from megatron_fr.parallel.spawn import run_on_ranks


def snapshot(learner) -> list[torch.Tensor]:
    return [p.detach().clone() for p in learner.module.parameters()]


def unchanged(before: list[torch.Tensor], learner) -> bool:
    return all(torch.equal(a, b) for a, b in zip(before, snapshot(learner), strict=True))


class NanLoss:
    """Makes the learner's policy loss NaN until removed."""

    def __init__(self, learner) -> None:
        self.learner, original = learner, learner._loss

        def nan_loss(*args):
            loss, reported = original(*args)
            return loss * math.nan, {**reported, "loss": reported["loss"] * math.nan}

        learner._loss = nan_loss

    def remove(self) -> None:
        del self.learner._loss


def poisoned_steps(rank: int, world_size: int, batch) -> list[tuple]:
    """(cause, loss finite, weights unchanged, Adam step counts, scheduler steps, steps done)
    per step: clean; NaN logits (the final hidden states the loss path scores made NaN: the
    gate admits nothing, so the loss is 0, but the gradient is NaN); a NaN loss; a NaN
    gradient of one parameter; clean."""
    from megatron_fr.config import LearnerConfig, ParallelConfig
    from megatron_fr.learner.trainer import Learner, adam_step_counts
    from megatron_fr.models.hf_config import load_hf_config
    from megatron_fr.parallel import state

    parallel = ParallelConfig(expert=2)
    state.initialize(parallel, seed=0)
    config = LearnerConfig(params_dtype="float32", micro_batch_tokens=40, lr=1e-3)
    learner = Learner(
        load_hf_config(dict(CONFIG, model_type="qwen3_moe")), parallel, config, total_steps=8
    )
    nan_hidden = lambda module, inputs, output: output * math.nan  # noqa: E731
    nan_grad = lambda grad: grad * math.nan  # noqa: E731
    weight = next(p for name, p in learner.module.named_parameters() if "linear_fc1" in name)
    poisons = [
        None,
        # the loss path scores the targets from these, never calling the output layer
        lambda: learner.module.decoder.final_layernorm.register_forward_hook(nan_hidden),
        lambda: NanLoss(learner),
        lambda: weight.register_hook(nan_grad),
        None,
    ]
    results = []
    for poison in poisons:
        handle = poison() if poison else None
        before = snapshot(learner)
        metrics = learner.train_step(batch)
        if handle is not None:
            handle.remove()
        results.append(
            (
                metrics.get("nonfinite"),
                math.isfinite(metrics["loss"]),
                unchanged(before, learner),
                adam_step_counts(learner.optimizer),
                learner.scheduler.num_steps,
                learner.steps_done,
            )
        )
    return results


@pytest.mark.distributed
def test_a_step_on_a_non_finite_loss_or_gradient_updates_nothing():
    per_rank = run_on_ranks(poisoned_steps, 2, random_batch(), timeout_s=600)
    assert per_rank[0] == per_rank[1], "ranks disagree"  # one decision for every rank
    clean, nan_logits, nan_loss, nan_grad, after = per_rank[0]
    assert clean[:3] == (None, True, False) and clean[3] == [1.0]
    assert nan_logits[:3] == ("gradient", True, True), nan_logits
    assert nan_loss[:3] == ("loss", False, True), nan_loss
    assert nan_grad[:3] == ("gradient", True, True), nan_grad
    for skipped in (nan_logits, nan_loss, nan_grad):
        assert skipped[3] == [1.0], "Adam stepped on a skipped step"
        assert skipped[4] == clean[4], "the LR schedule moved on a skipped step"
    assert after[:3] == (None, True, False) and after[3] == [2.0] and after[4] == clean[4] + 1
    assert [r[5] for r in per_rank[0]] == [1, 2, 3, 4, 5]  # every step is a step of the run
