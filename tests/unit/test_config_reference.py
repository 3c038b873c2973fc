"""The configuration's documentation comes from the schema: docs/config.md is what
`megatron-fr config reference` generates now (so it is current), every setting has its doc,
and `config show` prints a recipe's resolved values against defaults read from pydantic's own
field info, with a wrong key refused in one line."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_fr.cli import main
from megatron_fr.config.reference import render_reference, settings
from megatron_fr.config.run import RunConfig

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "examples" / "cpu_demo.yaml"


def test_the_config_reference_page_is_current():
    page = (REPO / "docs" / "config.md").read_text()
    assert page == render_reference(), (
        "docs/config.md is stale: .venv/bin/megatron-fr config reference --out docs/config.md"
    )


def test_every_setting_is_documented_and_every_field_reached():
    every = list(settings())
    assert not [s.key for s in every if not s.doc]
    keys = {s.key for s in every}
    assert set(RunConfig.model_fields) <= {key.split(".")[0] for key in keys}
    field = RunConfig.model_fields["eval"].annotation.model_fields["timeout_s"]
    eval_timeout = next(s for s in every if s.key == "eval.timeout_s")
    assert eval_timeout.default == str(field.default) and eval_timeout.doc == " ".join(
        field.description.split()
    )


def test_show_prints_resolved_values_with_their_defaults_and_docs(capsys):
    assert main(["config", "show", str(RECIPE), "eval", "eval.timeout_s=60"]) == 0
    out = capsys.readouterr().out
    default = RunConfig.model_fields["eval"].annotation.model_fields["timeout_s"].default
    assert f"eval.timeout_s = 60.0   (default {default})" in out
    assert "    Deadline of one evaluation" in out
    assert not [line for line in out.splitlines() if line.startswith("learner.")]


@pytest.mark.parametrize("key", ["eval.nope", "learner.lrr"])
def test_show_refuses_a_key_that_is_no_setting_in_one_line(key, capsys):
    assert main(["config", "show", str(RECIPE), key]) == 2
    err = capsys.readouterr().err.strip()
    remedy = "(megatron-fr config show RECIPE lists them)"
    assert err == f"megatron-fr config: error: {key!r} is not a setting {remedy}"
