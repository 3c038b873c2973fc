"""The top-K gate (learner.flash_reinforce.gate_kl = topk) is exactly layout-invariant: one
learner step through megatron on 4 real ranks, at TP2 + SP x CP2, at DP2 x CP2 and at TP2 + SP
x DP2 with unpacked rows, each with several micro-batches, gives the per-trajectory top-K KL,
the gate's decisions, the loss and the gradient norm of the single-process formula written out
below, computed from transformers' model of the same weights at the rollout temperature."""

from __future__ import annotations

import math

import pytest
import torch
from tiny_qwen import TINY, to_megatron_on_rank

from megatron_fr.buffer.trajectory import Trajectory
from megatron_fr.engine.top_logprobs import TopLogProbs
from megatron_fr.parallel.spawn import run_on_ranks

CONFIG = TINY["qwen3"]
TEMPERATURE, K, CLAMP = 0.7, 8, 1e-6
LAYOUTS = [  # (ParallelConfig kwargs, learner.micro_batch_tokens per GPU, pack rows)
    (dict(tensor=2, sequence_parallel=True, context=2), 12, True),  # packed rows of 24, CP-split
    (dict(context=2), 12, True),  # DP2 x CP2
    (dict(tensor=2, sequence_parallel=True), 16, False),  # DP2, one padded row per micro-batch
]


def hf_log_probs(hf_dir, batch: list[Trajectory]) -> list[torch.Tensor]:
    """([length - 1, V] log softmax(logits / T) of every trajectory, row p predicting token
    p + 1, with the gradient; the model they came from)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    rows = [
        torch.log_softmax(model(torch.tensor([t.token_ids[:-1]])).logits[0] / TEMPERATURE, -1)
        for t in batch
    ]
    return rows, model


def random_batch(hf_dir, size: int = 8) -> list[Trajectory]:
    """Trajectories whose engine distribution is the model's at temperature T with its logits
    shifted by noise of a per-trajectory scale (so the top-K KL spreads over the batch): the
    sampled tokens' log-probs and the top-K ids and log-probs are that distribution's."""
    generator = torch.Generator().manual_seed(4)
    shells = []
    for index in range(size):
        prompt = int(torch.randint(2, 5, (1,), generator=generator))
        response = int(torch.randint(3, 12, (1,), generator=generator))
        tokens = torch.randint(0, CONFIG["vocab_size"], (prompt + response,), generator=generator)
        mask = [False] * prompt + [True] * response
        reward = float(torch.rand(1, generator=generator) < 0.5)
        shells.append(
            Trajectory(
                f"p{index}",
                tokens.tolist(),
                mask,
                [0.0] * len(mask),
                [-1] * prompt + [0] * response,
                reward,
            )
        )
    with torch.no_grad():
        current, _ = hf_log_probs(hf_dir, shells)
    batch = []
    for index, (t, pi) in enumerate(zip(shells, current, strict=True)):
        scale = 0.05 * (index + 1)
        mu = torch.log_softmax(pi + scale * torch.randn(pi.shape, generator=generator), -1)
        policy = torch.tensor(t.action_mask[1:])
        targets = torch.tensor(t.token_ids[1:])
        sampled = torch.where(policy, mu.gather(-1, targets[:, None])[:, 0], 0).tolist()
        top = mu[policy].topk(K, -1)
        batch.append(
            Trajectory(
                t.prompt_id,
                t.token_ids,
                t.action_mask,
                [0.0, *sampled],
                t.token_versions,
                t.reward,
                top_logprobs=TopLogProbs.of(top.indices, top.values, K),
            )
        )
    return batch


def top_k_kl(mu: list[float], pi: list[float]) -> float:
    """KL over the K ids and one tail bucket (1 - their mass), each clamped to [1e-6, 1 - 1e-6]."""
    p, q = [math.exp(x) for x in mu], [math.exp(x) for x in pi]
    p, q = [*p, 1 - sum(p)], [*q, 1 - sum(q)]
    p, q = ([min(max(x, CLAMP), 1 - CLAMP) for x in v] for v in (p, q))
    return sum(a * math.log(a / b) for a, b in zip(p, q, strict=True))


def reference(hf_dir, batch: list[Trajectory], delta: float) -> dict:
    """The step written out on one process: per trajectory D_i = max(0, mean over its policy
    tokens of the top-K KL), m_i = [D_i <= delta], A_i = R_i - mean R,
    L = -(1/B) sum_i m_i A_i / T_i sum_t exp(pi - mu) pi (the ratio a constant), and the
    norm of L's gradient."""
    rows, model = hf_log_probs(hf_dir, batch)
    mean_reward = sum(t.reward for t in batch) / len(batch)
    loss, kls = 0.0, []
    for t, pi in zip(batch, rows, strict=True):
        policy = [p for p in range(t.length - 1) if t.action_mask[p + 1]]
        top = t.top_logprobs
        kl = sum(
            top_k_kl(top.log_probs[j].tolist(), pi[p, top.ids[j]].tolist())
            for j, p in enumerate(policy)
        ) / len(policy)
        kls.append(max(0.0, kl))
        if kls[-1] <= delta:
            for p in policy:
                token, mu = t.token_ids[p + 1], t.behavior_log_probs[p + 1]
                ratio = math.exp(pi[p, token].item() - mu)
                advantage = t.reward - mean_reward
                loss = loss - advantage / len(policy) * ratio * pi[p, token] / len(batch)
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    norm = math.sqrt(sum(float((grad**2).sum()) for grad in grads))
    admitted = [kl <= delta for kl in kls]
    return {
        "loss": loss.item(),
        "sequence_kl": kls,
        "admitted": admitted,
        "grad_norm": norm,
        "acceptance_rate": sum(admitted) / len(batch),
    }


def learner_steps(rank: int, world_size: int, megatron_dir: str, batch: list, delta: float):
    from megatron_fr.config import FlashReinforceConfig, LearnerConfig, ParallelConfig
    from megatron_fr.learner.trainer import Learner
    from megatron_fr.models.hf_config import load_hf_config
    from megatron_fr.parallel import state

    results = []
    for kwargs, budget, pack in LAYOUTS:
        parallel = ParallelConfig(**kwargs)
        state.initialize(parallel, seed=0)
        config = LearnerConfig(
            params_dtype="float32",
            micro_batch_tokens=budget,
            pack_sequences=pack,
            lr=1e-3,
            flash_reinforce=FlashReinforceConfig(delta=delta, gate_kl="topk", gate_top_k=K),
        )
        spec = load_hf_config(dict(CONFIG, model_type="qwen3"))
        learner = Learner(
            spec,
            parallel,
            config,
            total_steps=1,
            init_checkpoint=megatron_dir,
            temperature=TEMPERATURE,
        )
        results.append(learner.train_step(batch))
    return results


def micro_batches(kwargs: dict, budget: int, pack: bool, batch: list[Trajectory]) -> int:
    """Micro-batches per DP rank of the layout on 4 ranks."""
    from megatron_fr.learner.micro_batches import plan_micro_batches

    tp, cp = kwargs.get("tensor", 1), kwargs.get("context", 1)
    plan = plan_micro_batches(
        [t.length for t in batch],
        dp_size=4 // (tp * cp),
        micro_batch_tokens=budget,
        pack=pack,
        cp_size=cp,
        sequence_parallel_size=tp,
    )
    return plan.count


@pytest.mark.distributed
def test_top_k_gate_and_step_are_the_single_process_formula_in_every_layout(tmp_path):
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    torch.manual_seed(6)
    AutoModelForCausalLM.from_config(CONFIG_MAPPING["qwen3"](**CONFIG)).save_pretrained(
        tmp_path / "hf"
    )
    run_on_ranks(to_megatron_on_rank, 1, str(tmp_path / "hf"), str(tmp_path / "m"))
    batch = random_batch(tmp_path / "hf")
    probe = reference(tmp_path / "hf", batch, math.inf)["sequence_kl"]
    ordered = sorted(probe)
    delta = (ordered[3] + ordered[4]) / 2  # half the batch admitted
    expected = reference(tmp_path / "hf", batch, delta)
    assert 0 < expected["acceptance_rate"] < 1, "the gate should split this batch"

    per_rank = run_on_ranks(learner_steps, 4, str(tmp_path / "m"), batch, delta, timeout_s=900)
    for (kwargs, budget, pack), metrics, *others in zip(LAYOUTS, *per_rank, strict=True):
        where = f"{kwargs} budget {budget} pack {pack}"
        assert all(m == metrics for m in others), f"{where}: ranks disagree"
        assert micro_batches(kwargs, budget, pack, batch) > 1, f"{where}: one micro-batch only"
        assert metrics["admitted"] == expected["admitted"], where
        torch.testing.assert_close(
            torch.tensor(metrics["sequence_kl"], dtype=torch.float64),
            torch.tensor(expected["sequence_kl"], dtype=torch.float64),
            rtol=1e-5,
            atol=1e-7,
            msg=where,
        )
        assert metrics["acceptance_rate"] == pytest.approx(expected["acceptance_rate"]), where
        assert metrics["loss"] == pytest.approx(expected["loss"], abs=1e-5), where
        assert metrics["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-4), where
