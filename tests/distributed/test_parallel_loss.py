"""The parallel losses equal the single-process loss under every layout.

Each rank builds its own view of one global batch the way a learner would (trajectories split
over DP ranks and micro-batches, rows packed or not, rows split over CP ranks by megatron's
own get_batch_on_this_cp_rank, vocab split over TP ranks), scores its targets from its vocab
shard of the logits (vocab_parallel_log_probs), runs the parallel loss
(flash_reinforce_scored_loss, or ppo_clip_scored_loss with each aggregation and
correction) and backward, and scatters its logits gradient back into the global [B, T, V]
layout. The test process then checks, against the loss on the whole batch with
full-vocabulary log-softmax (algo's flash_reinforce_loss; for PPO-clip the formula written
out below, itself checked against algo's ppo_clip_loss):
  - sum of loss contributions over micro-batches and DP x CP ranks == L
  - sum of scattered gradients == dL/dlogits (each rank's shard lands in its own slice)
  - every rank agrees on which trajectories were admitted, and that equals the reference.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from megatron_fr.algo.flash_reinforce import flash_reinforce_loss
from megatron_fr.config import FlashReinforceConfig, ParallelConfig
from megatron_fr.parallel.spawn import run_on_ranks

BATCH, MAX_LEN, VOCAB = 7, 10, 16
LAYOUTS = {  # world size -> (tensor, data, context) layouts
    1: [(1, 1, 1)],
    2: [(2, 1, 1), (1, 2, 1), (1, 1, 2)],
    4: [(2, 2, 1), (2, 1, 2), (1, 2, 2)],
    8: [(2, 2, 2)],
}
VARIANTS = list(
    itertools.product(
        [0, 1],  # seed
        [1, 3],  # micro-batches per DP rank
        [False, True],  # packed rows
        [torch.float64, torch.float32],
        [  # the loss and its settings
            ("flash_reinforce", 1.0),  # negative_token_fraction q
            ("flash_reinforce", 0.5),
            ("ppo_clip", ("token_mean", "none")),  # aggregation, correction
            ("ppo_clip", ("sequence_mean", "sequence_mask_mean")),
            ("ppo_clip", ("token_sum_norm", "token_mask")),
            ("ppo_clip", ("sequence_mean", "sequence_mask_sum")),
        ],
    )
)
EPS_LOW, EPS_HIGH, LOW, HIGH = 0.2, 0.28, 0.9, 1.1
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}


def make_case(seed: int, dtype: torch.dtype) -> dict:
    """One global batch: full logits [B, T, V] and everything the loss needs."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, MAX_LEN + 1, (BATCH,), generator=gen)
    logits = torch.randn(BATCH, MAX_LEN, VOCAB, generator=gen, dtype=torch.float64) * 2
    targets = torch.randint(0, VOCAB, (BATCH, MAX_LEN), generator=gen)
    valid = torch.arange(MAX_LEN)[None] < lengths[:, None]
    mask = valid & (torch.rand(BATCH, MAX_LEN, generator=gen) < 0.8)
    mask[:, 0] = True  # at least one policy token per trajectory
    drift = torch.rand(BATCH, 1, 1, generator=gen, dtype=torch.float64) ** 2 * 0.5
    behavior_logits = logits + drift * torch.randn(logits.shape, generator=gen, dtype=torch.float64)
    mu = torch.log_softmax(behavior_logits, -1).gather(-1, targets[..., None])[..., 0]
    case = dict(
        lengths=lengths,
        logits=logits.to(dtype),
        targets=targets * valid,
        mask=mask,
        mu=torch.where(mask, mu, 0).to(dtype),
        rewards=torch.randn(BATCH, generator=gen, dtype=torch.float64).to(dtype),
        failures=torch.rand(BATCH, generator=gen) < 0.5,
    )
    case["delta"] = middle_threshold(case)
    return case


def reference_log_probs(logits: torch.Tensor, case: dict):
    log_softmax = torch.log_softmax(logits, -1)
    log_probs = log_softmax.gather(-1, case["targets"][..., None])[..., 0]
    entropies = -(log_softmax.exp() * log_softmax).sum(-1)
    return torch.where(case["mask"], log_probs, 0), entropies.detach()


def middle_threshold(case: dict) -> float:
    """A delta halfway between two trajectories' D_i: about half the batch is admitted."""
    log_probs, _ = reference_log_probs(case["logits"].double(), case)
    _, metrics = flash_reinforce_loss(
        log_probs, case["mu"].double(), case["rewards"].double(), case["mask"], delta=math.inf
    )
    kls = sorted(metrics["sequence_kl"].tolist())
    return (kls[BATCH // 2 - 1] + kls[BATCH // 2]) / 2


def reference(case: dict, loss_spec: tuple):
    """Loss, gradient w.r.t. the full logits, admitted [B] from the single-process function."""
    name, setting = loss_spec
    logits = case["logits"].double().clone().requires_grad_(True)
    log_probs, entropies = reference_log_probs(logits, case)
    if name == "ppo_clip":
        loss, admitted = ppo_clip_reference(log_probs, case, *setting)
        loss.backward()
        return loss.item(), logits.grad, admitted
    loss, metrics = flash_reinforce_loss(
        log_probs,
        case["mu"].double(),
        case["rewards"].double(),
        case["mask"],
        delta=case["delta"],
        negative_token_fraction=setting,
        entropies=entropies,
        failures=case["failures"],
    )
    loss.backward()
    return loss.item(), logits.grad, metrics["admitted"]


def ppo_clip_reference(log_probs, case: dict, aggregation: str, correction: str):
    """PPO-clip written out: l_t = -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A) on policy
    tokens kept by the correction, r = exp(pi - mu), A the trajectory's advantage (here the
    batch-centred reward); token_mean divides by all policy tokens, sequence_mean by B T_i,
    token_sum_norm by B max_i T_i."""
    mask, mu = case["mask"], case["mu"].double()
    advantage = (case["rewards"] - case["rewards"].mean()).double()[:, None]
    ratio = torch.exp(torch.where(mask, log_probs - mu, 0))
    token_loss = -torch.minimum(
        ratio * advantage, ratio.clamp(1 - EPS_LOW, 1 + EPS_HIGH) * advantage
    )
    log_ratio = torch.where(mask, log_probs.detach() - mu, 0)
    lengths = mask.sum(1).double()
    if correction == "token_mask":
        kept = mask & (log_ratio >= math.log(LOW)) & (log_ratio <= math.log(HIGH))
    elif correction.startswith("sequence_mask"):
        statistic = log_ratio.sum(1) / (lengths if correction.endswith("mean") else 1)
        inside = (statistic >= math.log(LOW)) & (statistic <= math.log(HIGH))
        kept = mask & inside[:, None]
    else:
        kept = mask
    token_loss = torch.where(kept, token_loss, 0)
    if aggregation == "token_mean":
        loss = token_loss.sum() / lengths.sum()
    elif aggregation == "sequence_mean":
        loss = (token_loss.sum(1) / lengths).mean()
    else:
        loss = token_loss.sum() / (BATCH * lengths.max())
    return loss, kept.any(1)


def test_ppo_clip_reference_agrees_with_the_algo_function():
    """The written-out reference and algo.ppo_clip_loss are the same loss (second opinion)."""
    from megatron_fr.algo.ppo import ppo_clip_loss
    from megatron_fr.config.algo import PPOClipConfig

    case = make_case(0, torch.float64)
    mask = case["mask"]
    segments = torch.where(mask, torch.arange(BATCH)[:, None], -1)
    for aggregation in ("token_mean", "sequence_mean", "token_sum_norm"):
        log_probs, _ = reference_log_probs(case["logits"], case)
        mine, _ = ppo_clip_reference(log_probs, case, aggregation, "none")
        config = PPOClipConfig(eps_low=EPS_LOW, eps_high=EPS_HIGH, aggregation=aggregation)
        theirs, _ = ppo_clip_loss(
            log_probs,
            case["mu"],
            case["rewards"] - case["rewards"].mean(),
            mask,
            segments,
            mask.sum(1),
            config,
        )
        assert abs(mine.item() - theirs.item()) <= 1e-12, aggregation


def micro_batches(trajectories: list[int], count: int) -> list[list[int]]:
    return [chunk for chunk in (trajectories[i::count] for i in range(count)) if chunk]


def build_rows(case: dict, trajectories: list[int], packed: bool, multiple: int) -> dict:
    """Rows of one micro-batch: one trajectory per row, or several packed back to back."""
    lengths = [int(case["lengths"][i]) for i in trajectories]
    if packed:  # first fit, capacity of two longest trajectories
        capacity, rows = 2 * MAX_LEN, []
        for index, length in zip(trajectories, lengths, strict=True):
            row = next((r for r in rows if sum(n for _, n in r) + length <= capacity), None)
            (row.append((index, length)) if row is not None else rows.append([(index, length)]))
    else:
        rows = [[(index, length)] for index, length in zip(trajectories, lengths, strict=True)]
    width = max(sum(length for _, length in row) for row in rows)
    width = -(-width // multiple) * multiple
    shape = (len(rows), width)
    out = dict(
        logits=torch.zeros(*shape, VOCAB, dtype=case["logits"].dtype),
        target_ids=torch.zeros(shape, dtype=torch.long),
        behavior_log_probs=torch.zeros(shape, dtype=case["mu"].dtype),
        action_mask=torch.zeros(shape, dtype=torch.bool),
        segment_ids=torch.full(shape, -1, dtype=torch.long),
        positions=torch.arange(width).expand(shape).clone(),
        token_index=torch.zeros(shape, dtype=torch.long),
    )
    for r, row in enumerate(rows):
        offset = 0
        for index, length in row:
            span = slice(offset, offset + length)
            out["logits"][r, span] = case["logits"][index, :length]
            out["target_ids"][r, span] = case["targets"][index, :length]
            out["behavior_log_probs"][r, span] = case["mu"][index, :length]
            out["action_mask"][r, span] = case["mask"][index, :length]
            out["segment_ids"][r, span] = index
            out["token_index"][r, span] = torch.arange(length)
            offset += length
    return out


def run_layouts(rank: int, world_size: int) -> list[dict]:
    from megatron.core import parallel_state as ps
    from megatron.core.utils import get_batch_on_this_cp_rank

    from megatron_fr.config.algo import PPOClipConfig
    from megatron_fr.parallel import state
    from megatron_fr.parallel.loss import (
        GlobalBatch,
        LossBatch,
        agreed_admission,
        flash_reinforce_scored_loss,
        ppo_clip_scored_loss,
    )
    from megatron_fr.parallel.vocab_parallel import vocab_parallel_log_probs

    results = []
    for tp, dp, cp in LAYOUTS[world_size]:
        state.initialize(ParallelConfig(tensor=tp, context=cp), seed=None)
        assert ps.get_data_parallel_world_size() == dp
        tp_rank = ps.get_tensor_model_parallel_rank()
        dp_rank = ps.get_data_parallel_rank()
        shard = slice(tp_rank * VOCAB // tp, (tp_rank + 1) * VOCAB // tp)
        for seed, n_micro, packed, dtype, (name, setting) in VARIANTS:
            case = make_case(seed, dtype)
            if name == "ppo_clip":
                config = PPOClipConfig(
                    eps_low=EPS_LOW,
                    eps_high=EPS_HIGH,
                    aggregation=setting[0],
                    correction=setting[1],
                    correction_low=LOW,
                    correction_high=HIGH,
                )
            else:
                config = FlashReinforceConfig(delta=case["delta"], negative_token_fraction=setting)
            advantages = case["rewards"] - case["rewards"].mean()
            global_batch = GlobalBatch(
                advantages=advantages,
                failures=case["failures"],
                token_counts=case["mask"].sum(1),
            )
            grad = torch.zeros(BATCH, MAX_LEN, VOCAB, dtype=torch.float64)
            loss_sum, per_micro = 0.0, []
            mine = list(range(dp_rank, BATCH, dp))
            for trajectories in micro_batches(mine, n_micro):
                rows = build_rows(case, trajectories, packed, multiple=2 * cp)
                rows = get_batch_on_this_cp_rank(
                    rows, is_hybrid_cp=False, cp_group=ps.get_context_parallel_group()
                )
                logits = rows.pop("logits")[..., shard].clone().requires_grad_(True)
                token_index = rows.pop("token_index")
                log_probs, entropies = vocab_parallel_log_probs(
                    logits,
                    rows["target_ids"],
                    ps.get_tensor_model_parallel_group(),
                    with_entropy=name == "flash_reinforce",
                )
                cp_group = ps.get_context_parallel_group()
                if name == "ppo_clip":
                    loss, metrics = ppo_clip_scored_loss(
                        log_probs, LossBatch(**rows), global_batch, config, cp_group=cp_group
                    )
                else:
                    loss, metrics = flash_reinforce_scored_loss(
                        log_probs,
                        entropies,
                        LossBatch(**rows),
                        global_batch,
                        config,
                        cp_group=cp_group,
                    )
                loss.backward()
                loss_sum += loss.item()
                per_micro.append(metrics)
                real = rows["segment_ids"] >= 0
                grad[rows["segment_ids"][real], token_index[real], shard] += logits.grad[
                    real
                ].double()
            admitted, present = agreed_admission(
                per_micro, ps.get_data_parallel_group(with_context_parallel=True)
            )
            results.append(
                dict(
                    layout=(tp, dp, cp),
                    variant=(seed, n_micro, packed, str(dtype), name, setting),
                    counts_loss=tp_rank == 0,
                    loss=loss_sum,
                    grad=grad,
                    admitted=admitted,
                    present=present,
                )
            )
    return results


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", sorted(LAYOUTS))
def test_parallel_loss_equals_single_process_loss(world_size):
    per_rank = run_on_ranks(run_layouts, world_size, timeout_s=900)
    references = {}
    for index, (seed, _, _, dtype, loss_spec) in enumerate(
        v for _ in LAYOUTS[world_size] for v in VARIANTS
    ):
        results = [rank_results[index] for rank_results in per_rank]
        key = (seed, dtype, loss_spec)
        if key not in references:
            references[key] = reference(make_case(seed, dtype), loss_spec)
        loss, grad, admitted = references[key]
        label = f"layout (tp, dp, cp)={results[0]['layout']} variant={results[0]['variant']}"
        tol = TOLERANCE[dtype]
        total = sum(r["loss"] for r in results if r["counts_loss"])
        assert abs(total - loss) <= tol, f"{label}: loss {total} != {loss}"
        gathered = sum(r["grad"] for r in results)
        assert (gathered - grad).abs().max() <= tol, f"{label}: gradient differs"

        for r in results:
            assert r["present"].all(), label
            assert r["admitted"].tolist() == admitted.tolist(), label
        if loss_spec[0] == "flash_reinforce" or loss_spec[1][1].startswith("sequence"):
            assert 0 < int(admitted.sum()) < BATCH, f"{label}: the gate should split this batch"
