"""Typed configs: layouts that cannot fit a world size are refused with the size named."""

from __future__ import annotations

import math
import typing
from pathlib import Path

import pydantic
import pytest

from megatron_fr.config import (
    FlashReinforceConfig,
    LearnerConfig,
    ParallelConfig,
    WeightSyncConfig,
)
from megatron_fr.config.rollout import RolloutSettings
from megatron_fr.config.run import load_run_config


def test_data_parallel_size_is_what_the_model_parallel_sizes_leave():
    assert ParallelConfig(tensor=2, pipeline=2).data_parallel_size(8) == 2
    assert ParallelConfig(tensor=2, context=2).data_parallel_size(4) == 1
    assert ParallelConfig(expert=4).data_parallel_size(4) == 4


@pytest.mark.parametrize(
    ("config", "world", "message"),
    [
        (dict(tensor=3), 4, r"not divisible by tensor \(3\)"),
        (dict(tensor=2, context=2), 6, "= 4"),
        (dict(expert=3), 4, r"expert \(3\)"),
        (dict(tensor=2, expert_tensor=1, expert=8), 4, "= 8"),
        (dict(sequence_parallel=True), 2, "sequence_parallel needs tensor > 1"),
        (dict(), 0, "world_size must be >= 1"),
    ],
)
def test_layout_that_does_not_fit_is_refused(config, world, message):
    with pytest.raises(ValueError, match=message):
        ParallelConfig(**config).data_parallel_size(world)


def test_expert_tensor_defaults_to_tensor_as_in_megatron():
    assert ParallelConfig(tensor=4).effective_expert_tensor == 4
    assert ParallelConfig(tensor=4, expert_tensor=1).effective_expert_tensor == 1


@pytest.mark.parametrize("bad", [dict(tensor=0), dict(context=-1), dict(bogus=1)])
def test_parallel_config_rejects_bad_fields(bad):
    with pytest.raises(pydantic.ValidationError):
        ParallelConfig(**bad)


def test_flash_reinforce_config_ranges():
    assert FlashReinforceConfig(delta=math.inf).delta == math.inf
    for bad in (dict(delta=-1.0), dict(delta=math.nan), dict(negative_token_fraction=1.1)):
        with pytest.raises(pydantic.ValidationError):
            FlashReinforceConfig(**bad)


def test_top_k_gate_is_optional_bounded_and_asks_for_k_log_probs_only_when_used():
    """The paper's Bernoulli gate by default; the top-K gate's K is bounded (its carriage
    cost, 8 K bytes per policy token), and rollouts carry top-K log-probs only when the
    FlashREINFORCE loss gates with it."""
    assert FlashReinforceConfig().gate_kl == "bernoulli"
    assert LearnerConfig().top_logprobs == 0
    topk = {"gate_kl": "topk", "gate_top_k": 16}
    assert LearnerConfig(flash_reinforce=topk).top_logprobs == 16
    assert LearnerConfig(flash_reinforce={"gate_kl": "topk"}).top_logprobs == 8
    assert LearnerConfig(estimator="grpo", flash_reinforce=topk).top_logprobs == 0
    for bad in (dict(gate_top_k=0), dict(gate_top_k=65), dict(gate_kl="full")):
        with pytest.raises(pydantic.ValidationError):
            FlashReinforceConfig(**bad)


def test_weight_sync_config_names_what_is_wrong():
    assert WeightSyncConfig().transport == "distributed"
    with pytest.raises(pydantic.ValidationError, match="needs directory"):
        WeightSyncConfig(transport="disk")
    for bad in (dict(transport="carrier-pigeon"), dict(bucket_mib=0), dict(timeout_s=0)):
        with pytest.raises(pydantic.ValidationError):
            WeightSyncConfig(**bad)


RECIPE = Path(__file__).resolve().parents[2] / "examples" / "cpu_demo.yaml"
POISONED = [
    ("learner.lr=.inf", "learner.lr"),
    ("rollout.temperature=.inf", "rollout.temperature"),
    ("rollout.temperature=.nan", "rollout.temperature"),
    ("eval.temperature=-.inf", "eval.temperature"),
    ("learner.clip_grad=.nan", "learner.clip_grad"),
    ("eval.timeout_s=1e300", "eval.timeout_s"),
    ("rollout.engine.watch_interval_s=.inf", "rollout.engine.watch_interval_s"),
    ("weights.timeout_s=1e12", "weights.timeout_s"),
    ("learner.ppo_clip.eps_high=.inf", "learner.ppo_clip.eps_high"),
    ("task.overlong_penalty=.inf", "task.overlong_penalty"),
    ("learner.flash_reinforce.delta=.nan", "learner.flash_reinforce.delta"),
]


@pytest.mark.parametrize(("override", "key"), POISONED, ids=[p[0] for p in POISONED])
def test_non_finite_and_absurd_numbers_are_refused_in_one_line_naming_the_key(override, key):
    with pytest.raises(ValueError) as refused:
        load_run_config(RECIPE, [override])
    message = str(refused.value)
    assert message.startswith(f"recipe {RECIPE}: {key}: ") and "\n" not in message, message


def test_an_infinite_gate_threshold_switches_the_gate_off():
    config = load_run_config(RECIPE, ["learner.flash_reinforce.delta=.inf"])
    assert config.learner.flash_reinforce.delta == math.inf


@pytest.mark.parametrize("override", ["learner.lr=.inf", "rollout.temperature=.inf"])
def test_check_fails_on_a_poisoned_number_with_one_line_naming_it(override, capsys):
    from megatron_fr.cli import main

    assert main(["train", str(RECIPE), "--check", override]) == 2
    err = capsys.readouterr().err.strip()
    key = override.split("=")[0]
    assert err.startswith("megatron-fr train: error: ") and f"{key}: " in err, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err


@pytest.mark.parametrize(
    "deadline",
    [
        "eval.timeout_s=1800",
        "rollout.engine.start_timeout_s=3600",
        "weights.timeout_s=1800",
        "weights.regroup_timeout_s=2000",
    ],
)
def test_check_refuses_a_deadline_that_reaches_the_collective_timeout(deadline, capsys):
    """The first rank waiting out the deadline would hold the others in collectives past
    parallel.timeout_minutes (30 min = 1,800 s): refused by --check, naming both keys."""
    from megatron_fr.cli import main

    assert main(["train", str(RECIPE), "--check", deadline]) == 2
    err = capsys.readouterr().err.strip()
    key = deadline.split("=")[0]
    assert f"{key}=" in err and "parallel.timeout_minutes=30 (1800 s)" in err, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    raised = load_run_config(RECIPE, [deadline, "parallel.timeout_minutes=61"])
    assert raised.parallel.timeout_minutes == 61  # the remedy it names is accepted


def _schemas(model: type[pydantic.BaseModel]) -> set[type[pydantic.BaseModel]]:
    """model and every pydantic model its fields hold, however nested (lists, dicts, unions)."""
    found, annotations = {model}, [f.annotation for f in model.model_fields.values()]
    while annotations:
        annotation = annotations.pop()
        if isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel):
            found |= _schemas(annotation)
        annotations.extend(typing.get_args(annotation))
    return found


def test_every_schema_of_a_recipe_and_of_the_demos_refuses_non_finite_numbers():
    from megatron_fr.config.base import StrictModel
    from megatron_fr.config.run import RunConfig
    from megatron_fr.demo.config import DemoModelConfig
    from megatron_fr.demo.text_math import TextMathConfig

    schemas = _schemas(RunConfig) | _schemas(DemoModelConfig) | _schemas(TextMathConfig)
    assert {"FlashReinforceConfig", "EngineSettings", "WandbConfig", "WarmStartConfig"} <= {
        schema.__name__ for schema in schemas
    }  # the walk reaches nested schemas, those added with the top-K gate and the demos'
    assert [s.__name__ for s in schemas if not issubclass(s, StrictModel)] == []
    with pytest.raises(pydantic.ValidationError, match="finite"):
        DemoModelConfig.model_validate({"warm_start": {"lr": math.inf}})


def test_a_request_timeout_below_the_stall_window_is_accepted_alone():
    """Lowering rollout.request_timeout_s alone is a valid recipe: the stall window only starts
    a probe of the engine (rollout/supervisor.py), so the two bounds are independent."""
    settings = RolloutSettings(request_timeout_s=1.0)
    assert settings.request_timeout_s == 1.0
    assert settings.engine.stalled_after_s > settings.request_timeout_s
