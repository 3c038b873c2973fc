"""The run simulator's event logic on cases worked out by hand.

Every case runs one server whose decode model is t(c) = 0.05 + 0.05 c seconds per iteration
(single stream 10 tokens/s, peak 20): a request alone decodes 10 tokens/s, two together
20/3 each, three 5 each, four 4 each. The learner takes a fixed time per step and the sync a
fixed latency, so every time below is written out from those rates.
"""

from __future__ import annotations

import dataclasses
import itertools
import json

import pytest

from megatron_fr.buffer.lag_buffer import BufferConfig
from megatron_fr.sim.cli import main
from megatron_fr.sim.config import SimConfig
from megatron_fr.sim.costs import DecodeModel
from megatron_fr.sim.engine import Scheme, StepRecord, grpo_sync
from megatron_fr.sim.lengths import RolloutLength
from megatron_fr.sim.result import simulate
from megatron_fr.sim.sweep import _choose


class Cycle:
    """Response lengths in a fixed order, repeated (prompt tokens 0)."""

    def __init__(self, responses: list[int], prompt: int = 0) -> None:
        self._responses = itertools.cycle(responses)
        self.prompt = prompt

    def draw(self) -> RolloutLength:
        return RolloutLength(self.prompt, next(self._responses))


def one_server(train_s: float, sync_s: float, steps: int, **server) -> SimConfig:
    return SimConfig.model_validate(
        {
            "cluster": {"rollout_nodes": 1, "learner_nodes": 1, "gpus_per_node": 1},
            "server": {
                "gpus_per_server": 1,
                "single_stream_tokens_per_s": 10.0,
                "peak_tokens_per_s": 20.0,
                **server,
            },
            "learner": {"seconds_per_step": train_s},
            "sync": {"bytes": 0, "latency_s": sync_s},
            "steps": steps,
            "warmup_steps": 0,
        }
    )


def flash(batch: int, max_lag: int, **buffer) -> Scheme:
    capacity = buffer.pop("capacity", (max_lag + 1) * batch)
    config = BufferConfig(batch_size=batch, max_lag=max_lag, capacity=capacity, **buffer)
    return Scheme("flash_reinforce", config)


def assert_steps(steps: list[StepRecord], expected: list[tuple]) -> None:
    """Each expected step: (ready, batch, trained, synced) seconds, then the batch's lags."""
    got = [((s.ready_s, s.batch_s, s.trained_s, s.synced_s), s.lags) for s in steps]
    want = [(tuple(float(x) for x in row[:4]), row[4]) for row in expected]
    assert [lags for _, lags in got] == [lags for _, lags in want]
    assert [t for t, _ in got] == [pytest.approx(t, abs=1e-9) for t, _ in want]


def test_decode_model_rates():
    decode = DecodeModel.from_settings(one_server(1, 1, 1).server)
    assert [decode.tokens_per_s(c) for c in (1, 2, 3, 4)] == pytest.approx([10, 20 / 3, 5, 4])
    assert 100 * decode.tokens_per_s(100) == pytest.approx(20 * 100 / 101)  # towards the peak
    assert decode.tokens_per_s(0) == 0


def test_lag_zero_two_rollouts_share_the_server():
    """B = 2, max_lag 0, responses of 20: both decode together at 20/3 tokens/s and finish at
    3 s; train 3 s, sync 1 s; the next two start at 7 s. Period 7 s."""
    result = simulate(one_server(3.0, 1.0, steps=3), flash(2, 0), Cycle([20]))
    assert_steps(
        result.steps, [(0, 3, 6, 7, (0, 0)), (7, 10, 13, 14, (0, 0)), (14, 17, 20, 21, (0, 0))]
    )
    assert result.window_s == pytest.approx(21)
    assert result.rollout_util == pytest.approx(40 / (20 * 7))  # 40 tokens per 7 s, peak 20/s
    assert result.rollout_busy == pytest.approx(3 / 7)
    assert result.mean_running_per_server == pytest.approx(2 * 3 / 7)
    assert (result.learner_util, result.sync_share, result.learner_wait) == pytest.approx(
        (3 / 7, 1 / 7, 3 / 7)
    )
    assert result.trajectories_per_hour == pytest.approx(2 * 3600 / 7)
    assert result.lag_histogram == {0: 6}
    assert result.drop_share == 0


def test_rollouts_overlap_training_at_lag_one():
    """B = 1, max_lag 1 (budget 2), responses 35, 10, 10, ...; train 2 s, sync 1 s.
    t=0: r0 (35) and r1 (10) at 20/3 each; r1 done at 1.5 -> step 1 trains to 3.5 while r0
    decodes alone (30 tokens by 3.5). Sync to 4.5; v=1 admits r2; r0 (5 left) and r2 run at
    20/3: r0 done at 5.25 -> step 2 on r0 at lag 1; r2 alone finishes 5 left at 5.75. After
    each sync the queued rollout is one version old: lag 1 from then on."""
    result = simulate(one_server(2.0, 1.0, steps=4), flash(1, 1), Cycle([35] + [10] * 10))
    assert_steps(
        result.steps,
        [
            (0, 1.5, 3.5, 4.5, (0,)),
            (4.5, 5.25, 7.25, 8.25, (1,)),
            (8.25, 8.25, 10.25, 11.25, (1,)),
            (11.25, 11.25, 13.25, 14.25, (1,)),
        ],
    )
    assert result.lag_histogram == {0: 1, 1: 3}
    assert result.lag_mean == pytest.approx(0.75)
    assert result.learner_wait == pytest.approx((1.5 + 0.75) / 14.25)


def test_overtaken_rollout_is_dropped_as_stale():
    """B = 1, max_lag 1, responses 95, 10, 10, ...: the long r0 is overtaken by a short rollout
    each step (every step: short done 1.5 s after the sync, train 2, sync 1 -> 4.5 s period).
    r0 decodes 10 + 20 per step; at 13.5 (v=3) it has 5 left; it finishes at 14.25 with
    oldest version 0 < 3 - 1 and is dropped, which frees its slot: r5 is admitted. r4 (10, 5
    done) finishes at 15.0, r5 (5 done by then, alone after) at 15.5, while step 4 trains."""
    result = simulate(one_server(2.0, 1.0, steps=4), flash(1, 1), Cycle([95] + [10] * 10))
    assert_steps(
        result.steps,
        [
            (0, 1.5, 3.5, 4.5, (0,)),
            (4.5, 6.0, 8.0, 9.0, (0,)),
            (9.0, 10.5, 12.5, 13.5, (0,)),
            (13.5, 15.0, 17.0, 18.0, (0,)),
        ],
    )
    completed = 6  # r1, r2, r3, r0 (dropped), r4, r5
    assert result.drop_share == pytest.approx(1 / completed)
    assert result.wasted_tokens == pytest.approx(95 / (95 + 5 * 10))
    assert result.masked_tokens == 0
    assert result.lag_histogram == {0: 4}


def test_overtaken_rollout_is_kept_on_its_recent_tokens_with_mask_stale_tokens():
    """The case above with buffer.stale_policy = mask_stale_tokens: r0 finishes at 14.25 at
    v=3 with its last tokens of version 3 (>= 3 - 1), so it is queued, and the waiting learner
    takes it at once (its version-0 tokens made context: lag 0 on what is trained). Nothing
    is dropped; step 4 trains 14.25 to 16.25 and syncs to 17.25. r0 had decoded 30 tokens by
    the end of version 0 and 60 by the end of version 1: the 60 older than 3 - 1 are made
    context. r4 (from 13.5: 5 tokens beside r0, 5 alone) is done at 14.75; r5 waits for
    version 4 (budget 2: r4 pending, r0 consumed at version 3). Decoded by 17.25: r0's 95,
    r1-r3's 30, r4's 10: 135."""
    scheme = flash(1, 1, stale_policy="mask_stale_tokens")
    result = simulate(one_server(2.0, 1.0, steps=4), scheme, Cycle([95] + [10] * 10))
    assert_steps(
        result.steps,
        [
            (0, 1.5, 3.5, 4.5, (0,)),
            (4.5, 6.0, 8.0, 9.0, (0,)),
            (9.0, 10.5, 12.5, 13.5, (0,)),
            (13.5, 14.25, 16.25, 17.25, (0,)),
        ],
    )
    assert result.drop_share == 0
    assert result.masked_tokens == pytest.approx(60 / 135)
    assert result.wasted_tokens == pytest.approx(60 / 135)


def test_grpo_sync_waits_for_the_whole_batch():
    """G = 2, B = 4: groups (10, 30) and (20, 20) start together at 4 tokens/s each; the 10
    ends at 2.5 s; three run at 5/s, the two 20s end at 4.5 s; the 30 runs alone at 10/s and
    ends at 5.5 s. Train 2 s, sync 1 s: period 8.5 s, nothing generates while training."""
    scheme = grpo_sync(
        SimConfig().scheme.model_copy(update={"batch_size": 4, "grpo_group_size": 2})
    )
    result = simulate(one_server(2.0, 1.0, steps=2), scheme, Cycle([10, 30, 20, 20]))
    assert_steps(
        result.steps, [(0, 5.5, 7.5, 8.5, (0, 0, 0, 0)), (8.5, 14.0, 16.0, 17.0, (0, 0, 0, 0))]
    )
    assert result.rollout_util == pytest.approx(80 / (20 * 8.5))
    assert result.rollout_busy == pytest.approx(5.5 / 8.5)
    assert result.mean_running_per_server == pytest.approx((4 * 2.5 + 3 * 2 + 1 * 1) / 8.5)
    assert result.learner_util == pytest.approx(2 / 8.5)
    assert result.lag_histogram == {0: 8}


def test_server_queue_and_prefill():
    """max_running_requests 1 queues the second request; prefill at 100 tokens/s stalls 0.1 s
    per 10-token prompt. r0 (10): 0.1 + 1.0 -> 1.1; r1 (20) starts then: 0.1 + 2.0 -> 3.2."""
    config = one_server(1.0, 1.0, steps=1, max_running_requests=1, prefill_tokens_per_s=100.0)
    result = simulate(config, flash(2, 0), Cycle([10, 20], prompt=10))
    assert_steps(result.steps, [(0, 3.2, 4.2, 5.2, (0, 0))])


def test_same_seed_same_figures():
    config = SimConfig(steps=12, warmup_steps=2).with_split(1, 1)
    first, second = (simulate(config, grpo_sync(config.scheme)) for _ in range(2))
    assert first.to_dict() == second.to_dict()
    other = simulate(config.model_copy(update={"seed": 1}), grpo_sync(config.scheme))
    assert other.to_dict() != first.to_dict()


# --- the command line ---------------------------------------------------------------------

FAST = ["steps=16", "warmup_steps=4", "scheme.batch_size=32", "scheme.max_lag=2"]


def test_help_lists_every_setting(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    for section, model in SimConfig.model_fields.items():
        annotation = model.annotation
        names = annotation.model_fields if hasattr(annotation, "model_fields") else {"": None}
        for name in names:
            assert f"  {section}.{name} = " in text or f"  {section} = " in text


def test_sweep_writes_table_plot_and_json(tmp_path, capsys):
    png, out = tmp_path / "sweep.png", tmp_path / "sweep.json"
    args = ["--nodes", "4", "8", "--plot", str(png), "--json", str(out), *FAST]
    assert main(args) == 0
    table = capsys.readouterr().out
    assert table.count("flash_reinforce") == 2 and table.count("grpo_sync") == 2
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = json.loads(out.read_text())
    assert [(r["scheme"], r["rollout_nodes"], r["learner_nodes"]) for r in rows] == [
        ("flash_reinforce", 2, 2),
        ("grpo_sync", 2, 2),
        ("flash_reinforce", 4, 4),
        ("grpo_sync", 4, 4),
    ]
    grpo = [r for r in rows if r["scheme"] == "grpo_sync"]
    assert all(r["lag_histogram"] == {"0": 12 * 32} and r["drop_share"] == 0 for r in grpo)
    assert all(r["lag_max"] <= 2 for r in rows)


def test_suggest_explains_its_choice(tmp_path, capsys):
    png = tmp_path / "split.png"
    assert main(["--suggest", "--nodes", "4", "--target-lag", "1", "--plot", str(png), *FAST]) == 0
    text = capsys.readouterr().out
    assert "suggested for 4 nodes:" in text and "bound" in text
    assert png.is_file()


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("server.peak_tokens_per_s=50", "single_stream_tokens_per_s"),
        ("server.speed=3", "server.speed"),
        ("server.gpus_per_server=3", "must divide cluster.gpus_per_node"),
        ("lengths.file=/nonexistent.jsonl", "lengths file /nonexistent.jsonl not found"),
        ("learner.model=/nonexistent", "no config.json at '/nonexistent'"),
    ],
)
def test_bad_settings_are_named(capsys, override, message):
    assert main([override, *FAST]) == 2
    assert message in capsys.readouterr().err


def test_split_choice_rules():
    """Drop limit first, then throughput within 2 %, then the lowest mean lag; when every
    split drops too much, the limit is set aside and the report says so."""
    config = one_server(1.0, 1.0, steps=2)
    base = simulate(config, flash(2, 0), Cycle([20]))

    def split(rollout, per_hour, lag, drop, wait=0.0):
        return dataclasses.replace(
            base,
            rollout_nodes=rollout,
            learner_nodes=8 - rollout,
            trajectories_per_hour=per_hour,
            lag_mean=lag,
            drop_share=drop,
            learner_wait=wait,
        )

    results = [
        split(2, 900, 1.0, 0.01),
        split(3, 1000, 3.0, 0.2),
        split(4, 985, 2.0, 0.03),
        split(5, 990, 2.5, 0.04),
    ]
    chosen, reason = _choose(results, 0.05, 0.02, target_lag=4, budget=10)
    assert chosen.rollout_nodes == 4  # 3 drops too much; 4 and 5 within 2 % of 990; 4 lags less
    assert reason.startswith("4 rollout + 4 learner nodes: 985 trajectories/h at lag mean 2.00")
    assert "Learner-bound" in reason and "2 splits come within 2%" in reason
    assert "With 3 rollout nodes: 1,000 trajectories/h" in reason
    chosen, reason = _choose(results, 0.001, 0.02, target_lag=4, budget=10)
    assert chosen.rollout_nodes == 4  # 3, 4, 5 within 2 % of 1000: 4 lags least
    assert "No split keeps drops under 0%" in reason
    assert "the least is 1.0% (2 rollout nodes" in reason
    rollout_bound = [split(2, 900, 1.0, 0.0, wait=0.5)]
    _, reason = _choose(rollout_bound, 0.05, 0.02, target_lag=4, budget=10)
    assert "Rollout-bound: the learner waits 50%" in reason and "budget (10 pending" in reason
