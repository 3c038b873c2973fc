"""One learner step through megatron's schedule, DDP and distributed optimizer computes the loss
and gradient of FlashREINFORCE on the whole batch, in every layout, with several micro-batches
of packed rows (context parallelism included): checked against transformers' model and the
single-process loss of algo/."""

from __future__ import annotations

import pytest
import torch
from tiny_qwen import TINY, to_megatron_on_rank

from megatron_fr.buffer.trajectory import Trajectory
from megatron_fr.parallel.spawn import run_on_ranks

# no auxiliary loss, so the gradient is FlashREINFORCE's alone (transformers adds none either)
CONFIG = dict(TINY["qwen3_moe"], router_aux_loss_coef=0.0)
LAYOUTS = [  # (ParallelConfig kwargs, learner.micro_batch_tokens: tokens per GPU)
    (dict(), 10_000),  # DP2, one micro-batch each
    (dict(expert=2), 40),  # EP2 (DP2 for the dense part), several micro-batches
    (dict(tensor=2, sequence_parallel=True), 30),  # TP2+SP, one trajectory per micro-batch
    (dict(context=2), 12),  # CP2: each packed row (24 tokens) split over both ranks, several
]
DELTA = 1e-3


def random_batch(seed: int = 0, size: int = 6) -> list[Trajectory]:
    generator = torch.Generator().manual_seed(seed)
    batch = []
    for index in range(size):
        prompt = int(torch.randint(2, 5, (1,), generator=generator))
        response = int(torch.randint(3, 12, (1,), generator=generator))
        tokens = torch.randint(0, 128, (prompt + response,), generator=generator).tolist()
        mask = [False] * prompt + [True] * response
        # near-on-policy behaviour (so the gate admits some) plus noise
        behavior = [0.0] * prompt + (-4.8 + 0.3 * torch.randn(response, generator=generator)).clamp(
            max=-0.01
        ).tolist()
        versions = [-1] * prompt + [0] * response
        reward = float(torch.rand(1, generator=generator) < 0.5)
        batch.append(Trajectory(f"p{index}", tokens, mask, behavior, versions, reward))
    return batch


def reference(hf_dir, batch: list[Trajectory]) -> tuple[float, float, float, dict]:
    """(loss, acceptance, grad norm, per-trajectory gate decisions and KL) from transformers'
    model and algo.flash_reinforce_loss."""
    from transformers import AutoModelForCausalLM

    from megatron_fr.algo.flash_reinforce import flash_reinforce_loss

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    width = max(t.length for t in batch) - 1
    log_probs = torch.zeros(len(batch), width)
    behavior = torch.zeros(len(batch), width)
    mask = torch.zeros(len(batch), width, dtype=torch.bool)
    rows = []
    for row, t in enumerate(batch):
        tokens = torch.tensor([t.token_ids])
        logits = model(tokens[:, :-1]).logits[0]
        rows.append(torch.log_softmax(logits, -1).gather(-1, tokens[0, 1:, None])[:, 0])
        behavior[row, : t.length - 1] = torch.tensor(t.behavior_log_probs[1:])
        mask[row, : t.length - 1] = torch.tensor(t.action_mask[1:])
    log_probs = torch.stack([torch.nn.functional.pad(r, (0, width - r.numel())) for r in rows])
    rewards = torch.tensor([t.reward for t in batch])
    loss, metrics = flash_reinforce_loss(log_probs, behavior, rewards, mask, delta=DELTA)
    loss.backward()
    norm = torch.sqrt(sum((p.grad**2).sum() for p in model.parameters() if p.grad is not None))
    gate = {
        "admitted": metrics["admitted"].tolist(),
        "sequence_kl": metrics["sequence_kl"].detach(),
    }
    return loss.item(), metrics["acceptance_rate"].item(), norm.item(), gate


def learner_steps(rank: int, world_size: int, megatron_dir: str, batch: list[Trajectory]):
    from megatron_fr.config import FlashReinforceConfig, LearnerConfig, ParallelConfig
    from megatron_fr.learner.trainer import Learner, adam_step_counts
    from megatron_fr.models.hf_config import load_hf_config
    from megatron_fr.parallel import state

    results = []
    for kwargs, budget in LAYOUTS:
        parallel = ParallelConfig(**kwargs)
        state.initialize(parallel, seed=0)
        config = LearnerConfig(
            params_dtype="float32",
            micro_batch_tokens=budget,
            lr=1e-3,
            flash_reinforce=FlashReinforceConfig(delta=DELTA),
        )
        spec = load_hf_config(dict(CONFIG, model_type="qwen3_moe"))
        learner = Learner(spec, parallel, config, total_steps=4, init_checkpoint=megatron_dir)
        metrics = learner.train_step(batch)
        checkpoint = f"{megatron_dir}.step1.{len(results)}"
        learner.save(checkpoint)
        second = learner.train_step(batch)  # the optimizer really moved the weights
        third = learner.train_step(batch)
        # Resumed twice: load step 1, train step 2, save, load that, train step 3.
        resumed = Learner(spec, parallel, config, total_steps=4)
        resumed.load(checkpoint)  # model, Adam moments, LR schedule, step count
        again = resumed.train_step(batch)
        counts_once = adam_step_counts(resumed.optimizer)
        resumed.save(f"{checkpoint}.again")
        twice = Learner(spec, parallel, config, total_steps=4)
        twice.load(f"{checkpoint}.again")
        third_again = twice.train_step(batch)
        counts = (
            adam_step_counts(learner.optimizer),
            counts_once,
            adam_step_counts(twice.optimizer),
        )
        results.append((metrics, (second, third), (again, third_again), twice.steps_done, counts))
    return results


@pytest.mark.distributed
def test_learner_step_is_the_batch_loss_and_gradient_in_every_layout(tmp_path):
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(CONFIG_MAPPING["qwen3_moe"](**CONFIG))
    model.save_pretrained(tmp_path / "hf")
    run_on_ranks(to_megatron_on_rank, 1, str(tmp_path / "hf"), str(tmp_path / "m"))
    batch = random_batch()
    loss, acceptance, grad_norm, gate = reference(tmp_path / "hf", batch)
    assert 0 < acceptance < 1, "the gate should split this batch"

    per_rank = run_on_ranks(learner_steps, 2, str(tmp_path / "m"), batch, timeout_s=600)
    for (kwargs, budget), (metrics, second, again, steps, counts), (metrics_1, *_) in zip(
        LAYOUTS, per_rank[0], per_rank[1], strict=True
    ):
        where = f"{kwargs} budget {budget}"
        assert metrics == metrics_1, f"{where}: ranks disagree"
        assert abs(metrics["loss"] - loss) <= 1e-5, f"{where}: loss {metrics['loss']} vs {loss}"
        assert metrics["acceptance_rate"] == pytest.approx(acceptance, abs=1e-6), where
        # per trajectory, in batch order, as batches.jsonl records them
        assert metrics["admitted"] == gate["admitted"], where
        kl = torch.tensor(metrics["sequence_kl"], dtype=torch.float64)
        assert torch.allclose(kl, gate["sequence_kl"].double(), atol=1e-6), where
        assert metrics["grad_norm"] == pytest.approx(grad_norm, rel=1e-4), where
        assert metrics["update_successful"] == 1.0 and metrics["lr"] == pytest.approx(1e-3)
        assert second[0]["loss"] != metrics["loss"], f"{where}: the step changed nothing"
        assert again == second and steps == 3, f"{where}: resuming from the checkpoint differs"
        # Every parameter's Adam step equals the number of updates, after any number of resumes
        # (megatron restores one shared step tensor without TE/apex; see restore_adam_steps).
        assert counts == ([3.0], [2.0], [3.0]), f"{where}: Adam step counts {counts}"
