"""The slurm tier's gate (tests/slurm/conftest.py): a machine without root, or without slurm
and apt-get, skips the tier with the reason; MEGATRON_FR_REQUIRE_SLURM=1 (CI) turns that skip
into a failure; a machine that has what the tier needs passes the gate."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

CONFTEST = Path(__file__).resolve().parents[1] / "slurm" / "conftest.py"
REASON = (  # as the test tier's users are told it
    "needs root and apt-get to install slurm; set MEGATRON_FR_REQUIRE_SLURM=1 to make this an error"
)
SLURM = {"slurmctld", "slurmd", "sbatch", "munged"}


def tier_on(monkeypatch: pytest.MonkeyPatch, uid: int, commands: set[str]) -> ModuleType:
    """The slurm conftest, loaded as a module, on a machine where the user id is `uid` and
    only `commands` are on PATH."""
    spec = importlib.util.spec_from_file_location("slurm_tier_conftest", CONFTEST)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses look it up there
    spec.loader.exec_module(module)
    monkeypatch.setattr(module.os, "geteuid", lambda: uid)
    monkeypatch.setattr(module.shutil, "which", lambda name: name if name in commands else None)
    return module


@pytest.mark.parametrize("required", [None, "0"])
def test_not_root_skips_with_the_reason(monkeypatch, required):
    monkeypatch.delenv("MEGATRON_FR_REQUIRE_SLURM", raising=False)
    if required is not None:
        monkeypatch.setenv("MEGATRON_FR_REQUIRE_SLURM", required)
    tier = tier_on(monkeypatch, uid=1000, commands=SLURM | {"apt-get"})
    with pytest.raises(pytest.skip.Exception) as skipped:
        tier.check_prerequisites()
    assert str(skipped.value) == f"{REASON} (this machine: not root)"


def test_root_without_apt_or_slurm_skips_with_the_reason(monkeypatch):
    monkeypatch.delenv("MEGATRON_FR_REQUIRE_SLURM", raising=False)
    tier = tier_on(monkeypatch, uid=0, commands={"sbatch"})
    with pytest.raises(pytest.skip.Exception) as skipped:
        tier.check_prerequisites()
    assert str(skipped.value) == (
        f"{REASON} (this machine: slurm is not installed and there is no apt-get)"
    )


@pytest.mark.parametrize(("uid", "commands"), [(1000, SLURM), (0, SLURM - {"munged"})])
def test_required_turns_a_missing_prerequisite_into_a_failure(monkeypatch, uid, commands):
    monkeypatch.setenv("MEGATRON_FR_REQUIRE_SLURM", "1")
    tier = tier_on(monkeypatch, uid=uid, commands=commands)
    with pytest.raises(pytest.fail.Exception) as failed:
        tier.check_prerequisites()
    assert str(failed.value).startswith(f"{REASON} (this machine: ")


@pytest.mark.parametrize("commands", [{"apt-get"}, SLURM])
@pytest.mark.parametrize("required", [None, "1"])
def test_root_with_apt_or_slurm_passes_the_gate(monkeypatch, commands, required):
    monkeypatch.delenv("MEGATRON_FR_REQUIRE_SLURM", raising=False)
    if required is not None:
        monkeypatch.setenv("MEGATRON_FR_REQUIRE_SLURM", required)
    tier = tier_on(monkeypatch, uid=0, commands=commands)
    assert tier.missing_prerequisite() is None
    tier.check_prerequisites()  # neither skips nor fails
