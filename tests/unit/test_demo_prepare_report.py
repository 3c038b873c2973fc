"""`demo prepare` says what it made in plain words (demo/prepare.py: describe_warm_start),
not a dataclass's repr."""

from __future__ import annotations

from pathlib import Path

from megatron_fr.demo.prepare import describe_warm_start
from megatron_fr.demo.warm_start import WarmStartReport


def test_the_report_names_the_model_its_weights_and_how_well_it_starts() -> None:
    report = WarmStartReport(
        initial_loss=5.9839,
        final_loss=0.2128,
        steps_run=150,
        greedy_accuracy=0.2,
        sampled_reward=0.18,
        eval_problems=50,
        seconds=1173.04,
        model_sha256="41f47841" + "0" * 56,
    )
    assert describe_warm_start(report, Path("runs/models/cpu_demo")).splitlines() == [
        "demo model made: runs/models/cpu_demo",
        "  weights sha256 41f47841" + "0" * 56,
        "  warm start: 150 steps, loss 5.984 -> 0.213, 1173 s",
        "  on 50 held-out problems: greedy accuracy 0.200, sampled reward 0.180 (where RL starts)",
    ]
    reused = describe_warm_start(report.__class__(**{**vars(report), "reused": True}), Path("m"))
    assert reused.startswith("demo model reused (made before with the same settings): m\n")
    assert "WarmStartReport" not in reused
