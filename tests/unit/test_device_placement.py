"""The learner builds micro-batches and the batch's advantages on the CPU; on a GPU the model
and its logits live on the device. These tests run the placement code path with the model on
PyTorch's "meta" device and stubs that record where every tensor they are given lives: a
learner that fed CPU tensors to a CUDA model would fail exactly where these find a CPU tensor."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import torch

from megatron_fr.buffer.trajectory import Trajectory
from megatron_fr.config.learner import LearnerConfig
from megatron_fr.learner import policy_loss, trainer
from megatron_fr.learner.micro_batches import micro_batches_for_rank, plan_micro_batches
from megatron_fr.parallel.loss import GlobalBatch

META = torch.device("meta")


def batch() -> list[Trajectory]:
    return [
        Trajectory(
            f"p{k}",
            [1, 2, 3, 4, 5][: 3 + k],
            [False, True, True, True, True][: 3 + k],
            [0.0, -0.5, -0.25, -1.0, -0.1][: 3 + k],
            [-1, 0, 0, 0, 0][: 3 + k],
            1.0,
        )
        for k in range(3)
    ]


def tensors_of(value) -> list[tuple[str, torch.Tensor]]:
    if isinstance(value, torch.Tensor):
        return [("", value)]
    if dataclasses.is_dataclass(value):
        return [
            (f.name, t)
            for f in dataclasses.fields(value)
            for _, t in tensors_of(getattr(value, f.name))
        ]
    if isinstance(value, list | tuple):
        return [pair for item in value for pair in tensors_of(item)]
    return []


class RecordingModel:
    """Stands in for megatron's model: records the devices of what it is called with."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, torch.device]] = []

    def __call__(
        self,
        input_ids,
        positions,
        attention_mask=None,
        packed_seq_params=None,
        output_processor=None,
    ):
        for name, value in [
            ("input_ids", input_ids),
            ("positions", positions),
            ("targets", output_processor.targets),
            *tensors_of(packed_seq_params),
        ]:
            self.seen.append((name, value.device))
        return torch.empty(2, *input_ids.shape, device=input_ids.device)


def test_forward_step_moves_model_inputs_and_loss_batch_to_the_models_device():
    trajectories = batch()
    plan = plan_micro_batches([t.length for t in trajectories], dp_size=1, micro_batch_tokens=64)
    micros = micro_batches_for_rank(trajectories, plan, dp_rank=0)
    assert all(t.device.type == "cpu" for m in micros for _, t in tensors_of(m.loss_batch))
    scored = []
    scores = trainer.TargetScores(torch.empty(0))
    forward_step = trainer.forward_step_on(META, lambda micro, out: scored.append(micro), scores)
    model = RecordingModel()
    output, score = forward_step(iter(micros), model)
    score(output)
    assert model.seen and all(device == META for _, device in model.seen), model.seen
    loss_tensors = tensors_of(scored[0].loss_batch)
    assert loss_tensors and all(t.device == META for _, t in loss_tensors)


def test_the_loss_gets_the_global_batch_on_the_logits_device(monkeypatch):
    seen = {}

    def recording_loss(log_probs, entropies, loss_batch, global_batch, config, **groups):
        seen.update({name: t.device for name, t in tensors_of(global_batch)})
        present = torch.zeros(3, dtype=torch.bool, device=log_probs.device)
        retained = torch.zeros(3, dtype=torch.int64, device=log_probs.device)
        return log_probs.sum(), {
            "admitted": present,
            "present": present,
            "retained_per_trajectory": retained,
        }

    monkeypatch.setattr(policy_loss, "flash_reinforce_scored_loss", recording_loss)
    cpu_batch = GlobalBatch(
        advantages=torch.zeros(3),
        failures=torch.zeros(3, dtype=torch.bool),
        token_counts=torch.ones(3, dtype=torch.int64),
    )
    learner = SimpleNamespace(
        temperature=1.0,
        config=LearnerConfig(),
        policy_loss=policy_loss.policy_loss(LearnerConfig()),
        groups=SimpleNamespace(cp=None),
    )
    micro = SimpleNamespace(loss_batch=None)
    trainer.Learner._loss(learner, 1.0, cpu_batch, micro, torch.zeros(2, 4, 8, device=META))
    assert seen == {"advantages": META, "failures": META, "token_counts": META}


def test_the_policy_loss_is_chosen_once_from_the_config():
    """learner.policy_loss names the loss object; FlashREINFORCE reads entropies only for the
    negative-token filter (negative_token_fraction < 1), PPO-clip never."""
    from megatron_fr.config import FlashReinforceConfig

    chosen = policy_loss.policy_loss(LearnerConfig())
    assert isinstance(chosen, policy_loss.FlashReinforceLoss) and not chosen.needs_entropy
    filtered = LearnerConfig(flash_reinforce=FlashReinforceConfig(negative_token_fraction=0.5))
    assert policy_loss.policy_loss(filtered).needs_entropy
    grpo = policy_loss.policy_loss(LearnerConfig(estimator="grpo"))
    assert isinstance(grpo, policy_loss.PPOClipLoss) and not grpo.needs_entropy
