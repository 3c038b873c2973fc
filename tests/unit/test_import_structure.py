"""The package's structure holds: the layer contracts of pyproject.toml ([tool.importlinter],
checked by import-linter's own `lint-imports`), no import circle between modules (found with
Tarjan's algorithm on grimp's import graph, the graph import-linter itself reads), a config
that loads without the rest of the package and changes no environment variable, and commands
that only print (`--help`, `config show`) without torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

from megatron_fr.utils.cpu_kernels import OPT_OUT, PINNED

REPO = Path(__file__).resolve().parents[2]


def test_import_contracts_are_kept() -> None:
    result = subprocess.run(
        [str(Path(sys.executable).with_name("lint-imports")), "--no-cache"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-4000:]
    assert "BROKEN" not in result.stdout and "Contracts: 5 kept, 0 broken." in result.stdout


def import_circles(graph: grimp.ImportGraph, package: str) -> list[list[str]]:
    """Every strongly connected component of more than one module within `package`."""
    modules = sorted(m for m in graph.modules if m.startswith(package))
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for other in sorted(graph.find_modules_directly_imported_by(module)):
            if not other.startswith(package):
                continue
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in on_stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for module in modules:
        if module not in index:
            visit(module)
    return circles


def test_no_import_circles() -> None:
    assert import_circles(grimp.build_graph("megatron_fr"), "megatron_fr") == []


def test_the_circle_finder_finds_a_circle(tmp_path, monkeypatch) -> None:
    package = tmp_path / "loop_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from loop_pkg import b\n")
    (package / "b.py").write_text("from loop_pkg import c\n")
    (package / "c.py").write_text("import loop_pkg.a\n")
    (package / "d.py").write_text("import loop_pkg.a\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    graph = grimp.build_graph("loop_pkg", cache_dir=None)
    assert import_circles(graph, "loop_pkg") == [["loop_pkg.a", "loop_pkg.b", "loop_pkg.c"]]


def test_loading_a_recipe_imports_only_the_config_package() -> None:
    code = (
        "import json, sys; from megatron_fr.config.run import load_run_config; "
        "load_run_config('examples/cpu_demo.yaml'); "
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('megatron_fr', 'torch', 'megatron'))))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True
    )
    loaded = json.loads(result.stdout)
    outside = [m for m in loaded if not m.startswith(("megatron_fr.config", "megatron_fr.utils"))]
    assert outside == ["megatron_fr"], outside


def test_the_rollout_process_does_not_import_megatron() -> None:
    """The rollout process builds its service from these modules; megatron there would need
    the CPU shims of the learner's entry point (and its memory) for nothing."""
    code = (
        "import sys; import megatron_fr.orchestrator.rollout_process, "
        "megatron_fr.orchestrator.setup, megatron_fr.learner.step_plan; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'megatron'))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True
    )
    assert result.stdout.strip() == "[]"


def test_importing_the_config_loads_only_config_modules_and_sets_no_environment() -> None:
    """A recipe reader (a launcher, a notebook) imports the config without the package's
    compute, and finds its environment as it was: the CPU kernels are pinned by the entry
    points that compute (utils/cpu_kernels.py), not by an import."""
    code = (
        "import json, os, sys; before = dict(os.environ); import megatron_fr.config; "
        "print(json.dumps({'modules': sorted(m for m in sys.modules if m.split('.')[0] in "
        "('megatron_fr', 'torch', 'megatron', 'transformers')), 'changed': sorted(k for k in "
        "set(before) | set(os.environ) if before.get(k) != os.environ.get(k))}))"
    )
    unpinned = {k: v for k, v in os.environ.items() if k not in (*PINNED, OPT_OUT)}
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=unpinned,
        check=True,
    )
    loaded = json.loads(result.stdout)
    outside = [m for m in loaded["modules"] if not m.startswith("megatron_fr.config")]
    assert outside == ["megatron_fr"] and loaded["changed"] == []


def imported_modules(*command: str) -> set[str]:
    """Every module `python -m megatron_fr COMMAND` imported, as python -X importtime lists
    them (the real entry point, to its exit)."""
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "megatron_fr", *command],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [line.split("|")[-1].strip() for line in result.stderr.splitlines()]
    return {row for row in rows if row and row != "imported package"}


@pytest.mark.parametrize(
    "command",
    [("--help",), ("train", "--help"), ("config", "show", "examples/cpu_demo.yaml", "steps")],
)
def test_help_and_config_show_import_no_torch(command: tuple[str, ...]) -> None:
    """What only prints text waits for no tensor library: torch alone takes seconds."""
    modules = imported_modules(*command)
    assert "megatron_fr.cli" in modules  # the listing is the command's
    heavy = {m.split(".")[0] for m in modules} & {"torch", "megatron", "transformers", "matplotlib"}
    assert heavy == set()
