"""buffer.stale_policy: a rollout that spans weight updates dropped whole once its oldest policy
token is past max_lag (drop_trajectory), or kept while its newest is within it and trained on
its tokens within it only (mask_stale_tokens); and the length record the run's report reads.
Every expectation is written out by hand from make_trajectory's layout (test_lag_buffer.py):

    index      0   1   2   3   4   5
    mask       .   .   P   P   .   P        (prompt, turn 1, observation, turn 2)
    versions  -1  -1   o   o  -1   o+span
    log-probs  0   0 -.5 -.25  0  -1
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pydantic
import pytest
import torch
from test_lag_buffer import make_trajectory  # the layout above

from megatron_fr.algo.flash_reinforce import flash_reinforce_loss
from megatron_fr.buffer.lag_buffer import BufferConfig, LagAwareBuffer, LengthRecord
from megatron_fr.buffer.prompts import PromptSource
from megatron_fr.buffer.stale_tokens import STALE_TOKENS_MASKED, mask_stale_tokens
from megatron_fr.buffer.trajectory import Trajectory, to_tensors, validate_trajectory
from megatron_fr.engine.top_logprobs import TopLogProbs

DROP, MASK = "drop_trajectory", "mask_stale_tokens"


def one_slot_buffer(policy: str, version: int, max_lag: int = 1) -> LagAwareBuffer:
    """B = 1, G = 1 at `version`."""
    config = BufferConfig(capacity=4, batch_size=1, max_lag=max_lag, stale_policy=policy)
    buffer = LagAwareBuffer(config, PromptSource(["q0", "q1", "q2", "q3"], seed=0))
    buffer.set_version(version)
    return buffer


def put_one(buffer: LagAwareBuffer, oldest: int, span: int) -> str:
    admission = buffer.try_admit()
    assert admission is not None
    return buffer.put(make_trajectory(admission.prompt_ids[0], oldest, span))


def test_the_default_drops_a_rollout_whose_oldest_token_is_past_max_lag():
    assert BufferConfig(capacity=1, batch_size=1).stale_policy == DROP
    buffer = one_slot_buffer(DROP, version=3)
    assert put_one(buffer, oldest=1, span=2) == "dropped"  # tokens of versions 1, 1, 3
    assert buffer.stats()["dropped_total"] == 1
    assert buffer.next_batch(3) is None


def test_masking_keeps_the_rollout_and_trains_only_its_tokens_within_max_lag():
    buffer = one_slot_buffer(MASK, version=3)
    assert put_one(buffer, oldest=1, span=2) == "queued"  # versions 1, 1, 3; oldest allowed 2
    (trained,) = buffer.next_batch(3)
    assert trained.action_mask.tolist() == [False] * 5 + [True]
    assert trained.token_versions.tolist() == [-1, -1, -1, -1, -1, 3]
    assert trained.behavior_log_probs.tolist() == [0.0, 0.0, 0.0, 0.0, 0.0, -1.0]
    assert trained.token_ids.tolist() == [1, 2, 3, 4, 5, 6]  # the masked turn stays as context
    assert trained.info[STALE_TOKENS_MASKED] == 2
    validate_trajectory(trained)
    stats = buffer.stats()
    assert stats["stale_tokens_masked_total"] == 2
    assert stats["lag_histogram"] == {0: 1}  # lag of the oldest token trained
    assert stats["dropped_total"] == 0


def test_boundary_versions_exactly_max_lag_old_are_kept():
    # Oldest token exactly max_lag old: fresh under both rules, nothing masked.
    for policy in (DROP, MASK):
        buffer = one_slot_buffer(policy, version=3)
        assert put_one(buffer, oldest=2, span=1) == "queued"  # versions 2, 2, 3
        (trained,) = buffer.next_batch(3)
        assert STALE_TOKENS_MASKED not in trained.info
        assert trained.action_mask.tolist() == [False, False, True, True, False, True]
        assert buffer.stats()["lag_histogram"] == {1: 1}
    # Newest token exactly max_lag old: kept by masking, on that one token.
    buffer = one_slot_buffer(MASK, version=3)
    assert put_one(buffer, oldest=1, span=1) == "queued"  # versions 1, 1, 2
    (trained,) = buffer.next_batch(3)
    assert trained.token_versions.tolist() == [-1, -1, -1, -1, -1, 2]
    assert trained.info[STALE_TOKENS_MASKED] == 2
    assert buffer.stats()["lag_histogram"] == {1: 1}


def test_a_rollout_with_no_token_left_within_max_lag_is_dropped_and_its_problem_handed_out():
    buffer = one_slot_buffer(MASK, version=3)
    admission = buffer.try_admit()
    assert admission is not None
    trajectory = make_trajectory(admission.prompt_ids[0], 1, span=0)  # versions 1, 1, 1
    assert buffer.put(trajectory) == "dropped"
    assert buffer.stats()["dropped_total"] == 1
    assert buffer.state_dict()["source"]["requeued"] == [admission.problem]
    with pytest.raises(ValueError, match="no policy token of version >= 2"):
        mask_stale_tokens(trajectory, 2)


def test_a_queued_rollout_is_masked_at_the_version_its_batch_is_taken_at():
    # Queued at version 3 with tokens of versions 2, 2, 3 (nothing stale then).
    buffer = one_slot_buffer(MASK, version=3)
    assert put_one(buffer, oldest=2, span=1) == "queued"
    buffer.set_version(4)  # oldest allowed 3: the two version-2 tokens go, the group stays
    assert buffer.stats()["occupancy"] == 1
    (trained,) = buffer.next_batch(4)
    assert trained.token_versions.tolist() == [-1, -1, -1, -1, -1, 3]
    # The same at version 5 has nothing left: dropped from the queue.
    buffer = one_slot_buffer(MASK, version=3)
    assert put_one(buffer, oldest=2, span=1) == "queued"
    buffer.set_version(5)
    assert (buffer.stats()["occupancy"], buffer.stats()["dropped_total"]) == (0, 1)


def test_a_group_is_dropped_when_one_member_has_nothing_left():
    config = BufferConfig(capacity=4, batch_size=2, group_size=2, max_lag=1, stale_policy=MASK)
    buffer = LagAwareBuffer(config, PromptSource(["q0", "q1"], seed=0))
    buffer.set_version(3)
    admission = buffer.try_admit()
    assert admission is not None
    first, second = admission.prompt_ids
    assert buffer.put(make_trajectory(first, 1, span=2)) == "held"  # newest 3: fine alone
    assert buffer.put(make_trajectory(second, 1, span=0)) == "dropped"  # newest 1 < 2
    assert buffer.stats()["dropped_total"] == 2


def test_masking_removes_the_top_k_rows_of_the_masked_tokens():
    trajectory = Trajectory(
        prompt_id="q@0#0",
        token_ids=[1, 2, 3, 4],
        action_mask=[False, True, True, True],
        behavior_log_probs=[0.0, -0.1, -0.2, -0.3],
        token_versions=[-1, 4, 5, 6],
        reward=1.0,
        info={STALE_TOKENS_MASKED: 1},  # masked once before: counts add up
        top_logprobs=TopLogProbs.of(
            [[1, 2], [3, 4], [5, 6]], [[-0.1, -3], [-0.2, -3], [-1, -2]], 2
        ),
    )
    masked = mask_stale_tokens(trajectory, 6)
    assert masked.action_mask.tolist() == [False, False, False, True]
    assert masked.top_logprobs is not None
    assert masked.top_logprobs.ids.tolist() == [[5, 6]]
    assert np.allclose(masked.top_logprobs.log_probs, [[-1, -2]])
    assert masked.info[STALE_TOKENS_MASKED] == 3
    validate_trajectory(masked)
    assert mask_stale_tokens(trajectory, 4) is trajectory  # nothing that old


def test_the_loss_counts_only_the_tokens_left_in_a_masked_trajectory():
    """B = 2: row 0 masked down to its token 5 (versions 1, 1, 3 at version 3, max_lag 1),
    reward 1; row 1 fresh (3 policy tokens), reward 0. Advantages 0.5, -0.5. With the current
    log-probs equal to the engine's as generated, every ratio is 1, so
    d loss / d log pi(token t of row b) = -(A_b / T_b) / B: row 0 -0.5 / 1 / 2 = -0.25 at
    token 5 alone (T_0 = 1, not 3), row 1 +0.5 / 3 / 2 = 1/12 at tokens 2, 3, 5. The masked
    tokens' log-probs (-0.5, -0.25, against 0 recorded now) enter no KL: D_0 = 0."""
    masked = mask_stale_tokens(make_trajectory("q@0#0", 1, span=2), 2)
    fresh = dataclasses.replace(make_trajectory("q@1#0", 3, span=0), reward=0.0)
    batch = to_tensors([dataclasses.replace(masked, reward=1.0), fresh])
    generated = torch.tensor([[0.0, 0.0, -0.5, -0.25, 0.0, -1.0]] * 2)
    log_probs = generated.clone().requires_grad_(True)
    loss, metrics = flash_reinforce_loss(
        log_probs, batch["behavior_log_probs"], batch["rewards"], batch["action_mask"]
    )
    loss.backward()
    assert log_probs.grad is not None
    expected = torch.tensor(
        [[0, 0, 0, 0, 0, -0.25], [0, 0, 1 / 12, 1 / 12, 0, 1 / 12]], dtype=torch.float32
    )
    assert torch.allclose(log_probs.grad, expected)
    assert metrics["sequence_kl"].tolist() == [0.0, 0.0]
    assert metrics["admitted"].tolist() == [True, True]


def test_take_lengths_reports_generated_and_dropped_since_the_previous_call():
    buffer = one_slot_buffer(DROP, version=3)
    put_one(buffer, oldest=3, span=0)  # queued, 3 policy tokens
    put_one(buffer, oldest=1, span=0)  # dropped
    admission = buffer.try_admit()
    assert admission is not None
    short = Trajectory(
        prompt_id=admission.prompt_ids[0],
        token_ids=[1, 2],
        action_mask=[False, True],
        behavior_log_probs=[0.0, -1.0],
        token_versions=[-1, 3],
        reward=0.0,
    )
    buffer.put(short)  # queued, 1 policy token
    assert buffer.take_lengths() == LengthRecord(generated=[3, 3, 1], dropped_stale=[3])
    assert buffer.take_lengths() == LengthRecord()
    buffer.set_version(5)  # both queued ones are now too old
    assert buffer.take_lengths() == LengthRecord(generated=[], dropped_stale=[3, 1])


def test_config_refuses_an_unknown_policy():
    with pytest.raises(pydantic.ValidationError, match="stale_policy"):
        BufferConfig(capacity=1, batch_size=1, stale_policy="keep_everything")
