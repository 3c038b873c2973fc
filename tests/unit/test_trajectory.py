"""Trajectory: every invalid row is refused with its field named; to_tensors pads, masks and
aligns log-probs with the token they score, as the learner's next-token shift expects."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
import torch
from helpers import assert_close

from megatron_fr.buffer.trajectory import (
    InvalidTrajectory,
    Trajectory,
    to_tensors,
    validate_trajectory,
)
from megatron_fr.config.algo import MAX_GATE_TOP_K, TOP_K_ENTRY_BYTES
from megatron_fr.engine.routing import RoutedExperts
from megatron_fr.engine.top_logprobs import TopLogProbs

# prompt (2 tokens), policy turn (2), tool observation (1), policy turn (1)
TOKENS = [5, 6, 7, 8, 9, 10]
MASK = [False, False, True, True, False, True]
LOG_PROBS = [0.0, 0.0, -0.5, -1.25, 0.0, -0.125]
VERSIONS = [-1, -1, 3, 3, -1, 4]


def trajectory(**overrides) -> Trajectory:
    fields = dict(
        prompt_id="p0",
        token_ids=list(TOKENS),
        action_mask=list(MASK),
        behavior_log_probs=list(LOG_PROBS),
        token_versions=list(VERSIONS),
        reward=1.5,
        info={"turns": 2, "env": "python", "finish_reason": "stop"},
    )
    fields.update(overrides)
    return Trajectory(**fields)


def test_properties_of_a_multi_turn_row():
    t = validate_trajectory(trajectory())
    assert t.length == 6
    assert t.num_policy_tokens == 3
    assert t.oldest_version == 3  # the older of the two policy turns, not the last


def test_values_off_the_mask_are_not_checked():
    lps = [math.nan, 0.0, -0.5, -1.25, 7.0, -0.125]  # NaN on a prompt token, > 0 on a tool token
    assert validate_trajectory(trajectory(behavior_log_probs=lps)).num_policy_tokens == 3


def test_dict_round_trip_through_json():
    t = trajectory()
    assert Trajectory.from_dict(json.loads(json.dumps(t.to_dict()))) == t


def routing(positions: int = 5, layers: int = 3, top_k: int = 2, num_experts: int = 4):
    """Distinct experts per token and layer: (p + l + j) mod E for j < top_k."""
    p, layer, j = np.meshgrid(
        np.arange(positions), np.arange(layers), np.arange(top_k), indexing="ij"
    )
    return RoutedExperts.compact((p + layer + j) % num_experts, num_experts)


@pytest.mark.parametrize(
    ("num_experts", "dtype"), [(4, np.uint8), (256, np.uint8), (257, np.int16)]
)
def test_routed_experts_take_one_byte_per_id_up_to_256_experts(num_experts, dtype):
    experts = np.full((5, 3, 2), num_experts - 1)
    experts[..., 0] = 0
    record = RoutedExperts.compact(experts, num_experts)
    assert record.experts.dtype == dtype and record.experts.nbytes == 5 * 3 * 2 * dtype().nbytes
    t = validate_trajectory(trajectory(routed_experts=record))
    back = Trajectory.from_dict(json.loads(json.dumps(t.to_dict())))
    assert back == t and back.routed_experts.experts.dtype == dtype
    assert back != trajectory(routed_experts=routing(num_experts=num_experts))


def test_compacting_refuses_ids_that_narrowing_would_wrap():
    with pytest.raises(ValueError, match=r"in \[0, 4\)"):
        RoutedExperts.compact(np.array([[[0, 260]]]), 4)


def _spoiled(experts: np.ndarray, num_experts: int = 4) -> RoutedExperts:
    return RoutedExperts(experts, num_experts)


@pytest.mark.parametrize(
    ("record", "problem"),
    [
        (routing(positions=6), "positions differ from the tokens fed (length - 1)"),
        (routing(positions=4), "positions differ from the tokens fed (length - 1)"),
        (_spoiled(routing().experts[:, :, 0]), "is not [positions, layers, top_k]"),
        (_spoiled(routing().experts[:, :0]), "is not [positions, layers, top_k]"),
        (_spoiled(routing().experts.astype(np.int64)), "dtype is not uint8 or int16"),
        (_spoiled(routing(top_k=4).experts, num_experts=3), "top_k is not in [1, num_experts]"),
        (_spoiled(routing().experts, num_experts=3), "expert id out of range"),
        (_spoiled(routing().experts.astype(np.int16) - 1), "expert id out of range"),
        (_spoiled(np.zeros((5, 3, 2), np.uint8)), "repeats an expert within a top-k"),
        ("not a record", "is not a RoutedExperts array"),
    ],
)
def test_bad_routing_is_refused_with_its_reason(record, problem):
    with pytest.raises(InvalidTrajectory) as caught:
        validate_trajectory(trajectory(routed_experts=record))
    assert caught.value.reason == f"routed_experts: {problem}"


def test_out_of_range_detail_names_position_layer_and_slot():
    experts = routing().experts.copy()
    experts[3, 1, 1] = 9
    with pytest.raises(InvalidTrajectory, match=r"\[3, 1, 1\]: 9 not in \[0, 4\)"):
        validate_trajectory(trajectory(routed_experts=_spoiled(experts)))


def top(tokens: int = 3, k: int = 4) -> TopLogProbs:
    """Distinct ids per policy token and log-probs of mass < 1: token j's k-th id is j + k."""
    ids = np.arange(tokens)[:, None] + np.arange(k)[None]
    return TopLogProbs.of(ids, -1.5 - np.arange(k)[None].repeat(tokens, 0), k)


def _top_spoiled(ids=None, log_probs=None) -> TopLogProbs:
    record = top()
    return TopLogProbs(
        record.ids if ids is None else ids, record.log_probs if log_probs is None else log_probs
    )


def test_top_logprobs_cost_k_times_8_bytes_per_policy_token_and_survive_a_checkpoint():
    record = top(tokens=3, k=5)
    assert record.ids.nbytes + record.log_probs.nbytes == 3 * 5 * TOP_K_ENTRY_BYTES
    t = validate_trajectory(trajectory(top_logprobs=record))
    back = Trajectory.from_dict(json.loads(json.dumps(t.to_dict())))
    assert back == t and back.top_logprobs.ids.dtype == np.int32
    assert back.top_logprobs.log_probs.dtype == np.float32
    shifted = TopLogProbs.of(record.ids, record.log_probs - 0.5, 5)
    assert back != trajectory(top_logprobs=shifted)
    joined = TopLogProbs.concatenate([top(tokens=1), top(tokens=2)])
    assert joined.ids.tolist() == [[0, 1, 2, 3], [0, 1, 2, 3], [1, 2, 3, 4]]


def test_top_logprobs_below_float32_become_its_smallest_value_as_sglang_clamps():
    record = TopLogProbs.of([[3, 4]], [[-0.5, -1e300]], 2)
    assert record.log_probs[0, 1] == np.finfo(np.float32).min
    floored = TopLogProbs.of([[3, 4]] * 3, [[-0.5, -1e300]] * 3, 2)
    validate_trajectory(trajectory(top_logprobs=floored))  # finite: accepted


@pytest.mark.parametrize(
    ("record", "problem"),
    [
        (top(tokens=2), "rows differ from the policy tokens"),
        (top(tokens=4), "rows differ from the policy tokens"),
        (top(k=MAX_GATE_TOP_K + 1), f"is not [policy tokens, K] with K in [1, {MAX_GATE_TOP_K}]"),
        (_top_spoiled(ids=top().ids[:, :0]), "is not [policy tokens, K] with K in [1, 64]"),
        (_top_spoiled(ids=top().ids[:, :2]), "is not [policy tokens, K] with K in [1, 64]"),
        (_top_spoiled(ids=top().ids.astype(np.int64)), "dtypes are not int32 ids and float32"),
        (_top_spoiled(log_probs=top().log_probs.astype(np.float64)), "dtypes are not int32"),
        (_top_spoiled(ids=top().ids - 1), "holds a negative id"),
        (_top_spoiled(log_probs=top().log_probs * 0 + np.float32("nan")), "log-prob not finite"),
        (_top_spoiled(log_probs=top().log_probs * 0 - np.float32("inf")), "log-prob not finite"),
        (_top_spoiled(log_probs=-top().log_probs), "log-prob not finite or positive"),
        (_top_spoiled(ids=top().ids * 0 + np.int32(3)), "repeats a token within a top-K"),
        (
            _top_spoiled(log_probs=top().log_probs * 0 - np.float32(0.5)),
            "probabilities of a top-K sum above 1",
        ),
        ("not a record", "is not a TopLogProbs of arrays"),
    ],
)
def test_bad_top_logprobs_are_refused_with_their_reason(record, problem):
    with pytest.raises(InvalidTrajectory) as caught:
        validate_trajectory(trajectory(top_logprobs=record))
    assert caught.value.reason.startswith(f"top_logprobs: {problem}")


@pytest.mark.parametrize(
    ("overrides", "field", "problem"),
    [
        (
            dict(token_ids=[], action_mask=[], behavior_log_probs=[], token_versions=[]),
            "token_ids",
            "is empty",
        ),
        (dict(action_mask=MASK[:-1]), "action_mask", "length differs from token_ids"),
        (
            dict(behavior_log_probs=[*LOG_PROBS, -1.0]),
            "behavior_log_probs",
            "length differs from token_ids",
        ),
        (dict(token_versions=VERSIONS[:3]), "token_versions", "length differs from token_ids"),
        (dict(token_ids=[5, 6, -7, 8, 9, 10]), "token_ids", "holds a negative id"),
        (dict(action_mask=[False] * 6), "action_mask", "has no policy token"),
        (dict(action_mask=[True, *MASK[1:]]), "action_mask", "marks token 0 as a policy token"),
        (
            dict(behavior_log_probs=[0.0, 0.0, -0.5, math.nan, 0.0, -0.125]),
            "behavior_log_probs",
            "not finite under the action mask",
        ),
        (
            dict(behavior_log_probs=[0.0, 0.0, -0.5, -1.0, 0.0, -math.inf]),
            "behavior_log_probs",
            "not finite under the action mask",
        ),
        (
            dict(behavior_log_probs=[0.0, 0.0, 0.25, -1.0, 0.0, -0.125]),
            "behavior_log_probs",
            "positive under the action mask",
        ),
        (dict(token_versions=[-1, -1, 3, -1, -1, 4]), "token_versions", "negative on a policy"),
        (dict(token_versions=[-1, 3, 3, 3, -1, 4]), "token_versions", "not -1 on a non-policy"),
        (dict(reward=math.nan), "reward", "not finite"),
        (dict(reward=-math.inf), "reward", "not finite"),
        (dict(prompt_id=""), "prompt_id", "is not a non-empty string"),
        (dict(info={"tools": {"python"}}), "info", "is not JSON-serialisable"),
    ],
)
def test_invalid_trajectory_is_refused_with_its_field_named(overrides, field, problem):
    with pytest.raises(InvalidTrajectory) as caught:
        validate_trajectory(trajectory(**overrides))
    assert caught.value.field == field
    assert caught.value.reason.startswith(f"{field}: {problem}")
    assert str(caught.value).startswith(field)


def test_error_detail_names_the_offending_index():
    lps = [0.0, 0.0, -0.5, -1.0, 0.0, 0.5]
    with pytest.raises(InvalidTrajectory, match=r"index 5: 0\.5"):
        validate_trajectory(trajectory(behavior_log_probs=lps))


def test_oldest_version_of_a_row_without_policy_tokens_names_the_mask():
    with pytest.raises(InvalidTrajectory, match="action_mask: has no policy token"):
        _ = trajectory(action_mask=[False] * 6).oldest_version


@pytest.mark.parametrize("pad_id", [0, 99])
def test_to_tensors_pads_masks_and_zeroes_off_mask_values(pad_id):
    # Junk log-probs off the mask (-3.0 on a prompt token) must not reach the batch.
    first = trajectory(behavior_log_probs=[-3.0, 0.0, -0.5, -1.25, 0.0, -0.125])
    second = trajectory(
        prompt_id="p1",
        token_ids=[11, 12, 13, 14],
        action_mask=[False, True, False, True],
        behavior_log_probs=[0.0, -2.0, 0.0, -0.75],
        token_versions=[-1, 5, -1, 6],
        reward=-0.5,
    )
    batch = to_tensors([first, second], pad_id=pad_id)
    assert set(batch) == {"token_ids", "action_mask", "behavior_log_probs", "rewards", "lengths"}
    p = pad_id
    assert_close(
        batch["token_ids"], torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, p, p]]), atol=0
    )
    assert torch.equal(
        batch["action_mask"],
        torch.tensor(
            [[False, False, True, True, False, True], [False, True, False, True, False, False]]
        ),
    )
    assert_close(
        batch["behavior_log_probs"],
        torch.tensor(
            [[0.0, 0.0, -0.5, -1.25, 0.0, -0.125], [0.0, -2.0, 0.0, -0.75, 0.0, 0.0]],
            dtype=torch.float32,
        ),
        atol=0,
    )
    assert_close(batch["rewards"], torch.tensor([1.5, -0.5], dtype=torch.float32), atol=0)
    assert_close(batch["lengths"], torch.tensor([6, 4]), atol=0)


def test_index_t_scores_token_t_so_the_learner_shift_reproduces_the_behavior_log_probs():
    """Sample with a bigram 'policy' the way an engine reports it (log p of the token it just
    sampled), then score with the shift to_tensors documents: inputs [:, :-1], targets [:, 1:]."""
    gen = torch.Generator().manual_seed(0)
    vocab = 7
    table = torch.randn(vocab, vocab, generator=gen, dtype=torch.float64).log_softmax(-1)
    rows = []
    for row, (length, first_policy) in enumerate([(6, 2), (4, 1)]):
        tokens, lps = [int(torch.randint(vocab, (1,), generator=gen))], [0.0]
        for _ in range(length - 1):
            nxt = int(torch.multinomial(table[tokens[-1]].exp(), 1, generator=gen))
            lps.append(float(table[tokens[-1], nxt]))
            tokens.append(nxt)
        mask = [t >= first_policy for t in range(length)]
        rows.append(
            Trajectory(
                prompt_id=f"p{row}",
                token_ids=tokens,
                action_mask=mask,
                behavior_log_probs=[lp if m else 0.0 for lp, m in zip(lps, mask, strict=True)],
                token_versions=[0 if m else -1 for m in mask],
                reward=0.0,
            )
        )
    batch = to_tensors(rows)
    inputs, targets = batch["token_ids"][:, :-1], batch["token_ids"][:, 1:]
    learner = table[inputs].gather(-1, targets.unsqueeze(-1)).squeeze(-1).float()
    mask = batch["action_mask"][:, 1:]
    assert not batch["action_mask"][:, 0].any()
    assert mask.sum() == 4 + 3
    assert_close(learner[mask], batch["behavior_log_probs"][:, 1:][mask], atol=1e-6)


def test_to_tensors_refuses_bad_input():
    with pytest.raises(ValueError, match="at least one trajectory"):
        to_tensors([])
    with pytest.raises(ValueError, match="pad_id must be a token id >= 0"):
        to_tensors([trajectory()], pad_id=-1)
    with pytest.raises(InvalidTrajectory, match="reward: not finite"):
        to_tensors([trajectory(), dataclasses.replace(trajectory(), reward=math.nan)])
