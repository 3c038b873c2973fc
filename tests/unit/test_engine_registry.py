"""One backend object per engine kind, found in one registry (engine/backends.py), beside one
row of capabilities per kind (config/engine_kinds.py); nothing else in the package switches
on a kind."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import get_args

import pytest

from megatron_fr.config import engine_kinds
from megatron_fr.config.engine_kinds import ENGINE_KINDS, EngineKind
from megatron_fr.config.run import load_run_config
from megatron_fr.engine.backends import BACKENDS, backend_for

REPO = Path(__file__).resolve().parents[2]
KINDS = set(get_args(EngineKind))
ALLOWED = {
    "megatron_fr/engine/backends.py",
    "megatron_fr/config/engine_kinds.py",
    *(f"megatron_fr/engine/{kind}" for kind in KINDS),
}
"""Where a kind may be named in a comparison: the registry, the capabilities and each kind's
own folder."""


def test_every_kind_has_one_backend_and_one_row_of_capabilities() -> None:
    assert set(BACKENDS) == set(ENGINE_KINDS) == KINDS
    for kind, backend in BACKENDS.items():
        assert backend.kind == kind and backend.capabilities is ENGINE_KINDS[kind]
    with pytest.raises(ValueError, match="engine kind 'tgi': one of"):
        backend_for("tgi")


def test_the_recipe_is_refused_by_what_the_kinds_row_says(monkeypatch) -> None:
    """The refusal follows the row, not the kind's name: the CPU engine's recipe with the
    top-K gate loads; with a row that says it has no top-K log-probs it is refused, naming
    the setting and the kind's name from the row."""
    recipe = REPO / "examples" / "cpu_demo.yaml"
    topk = ["learner.flash_reinforce.gate_kl=topk", "rollout.engine.kind=cpu"]
    load_run_config(recipe, topk)
    without = ENGINE_KINDS["cpu"].model_copy(update={"top_logprobs": False, "name": "Engine X"})
    monkeypatch.setitem(engine_kinds.ENGINE_KINDS, "cpu", without)
    refusal = "kind cpu with learner.flash_reinforce.gate_kl=topk: top-K log-probs are not read "
    with pytest.raises(ValueError, match=re.escape(refusal + "from Engine X")):
        load_run_config(recipe, topk)


def _kind_comparisons(path: Path) -> list[int]:
    """Lines of `path` that compare a kind (a name or attribute spelled *kind or *engine) with
    an engine kind's name."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        names = {s.value for s in sides if isinstance(s, ast.Constant)}
        names |= {
            e.value
            for s in sides
            if isinstance(s, ast.Tuple | ast.Set | ast.List)
            for e in s.elts
            if isinstance(e, ast.Constant)
        }
        spelled = [ast.unparse(s) for s in sides if not isinstance(s, ast.Constant)]
        by_kind = any(text.endswith(("kind", "engine")) for text in spelled)
        if names & KINDS and by_kind:
            lines.append(node.lineno)
    return lines


def test_no_code_outside_the_registry_and_the_kinds_folders_switches_on_a_kind() -> None:
    found = {}
    for path in sorted((REPO / "megatron_fr").rglob("*.py")):
        where = str(path.relative_to(REPO))
        if any(where == allowed or where.startswith(allowed + "/") for allowed in ALLOWED):
            continue
        if lines := _kind_comparisons(path):
            found[where] = lines
    assert found == {}
    sample = REPO / "megatron_fr" / "engine" / "sglang" / "backend.py"
    assert _kind_comparisons(sample) == []  # the scan itself: see the next test


def test_the_scan_finds_a_switch_on_a_kind(tmp_path) -> None:
    code = tmp_path / "switch.py"
    code.write_text(
        "def f(engine, config):\n"
        "    if engine.kind == 'vllm':\n"
        "        return 1\n"
        "    return config.rollout.engine.kind in ('sglang', 'cpu')\n"
        "def g(param):\n"
        "    return param.device.type == 'cpu'\n"
    )
    assert _kind_comparisons(code) == [2, 4]


def test_the_cpu_engine_is_started_without_asking_for_cuda() -> None:
    """Asking imports torch; the CPU engine's command, environment and machine check never
    need the answer, so `megatron-fr serve --engine cpu` does not pay for it."""
    from megatron_fr.engine.server_config import ServerLaunchConfig

    def asked() -> bool:
        raise AssertionError("the CPU engine's launch asked whether CUDA is there")

    cpu = backend_for("cpu")
    cfg = ServerLaunchConfig(model_path="m", engine="cpu")
    assert cpu.command(cfg, asked, False)[-2:] == ["--threads", "1"]
    assert cpu.environment({"A": "1"}, asked) == {"A": "1"}
    cpu.check_machine("rollout.engine.kind", "remedy", None, asked)
