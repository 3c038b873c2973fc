"""The HTTP contract with vLLM, read from the installed vLLM's source (never imported: it lives
in its own environment, .venv-vllm): every route the project's vLLM wire calls
(engine/vllm/wire.py: ROUTES) is a route of vLLM's server with that method (the `@router.get`
/ `@router.post` decorators of its entrypoints' api_router.py files), and every key of a
generate request is a field of vLLM's GenerateRequest, every sampling key a field of its
SamplingParams, the sizes engine/server_info.py reads of a vLLM server are fields of its
ParallelConfig, the pause modes the wire sends are vLLM's PauseMode, and the project's code
that speaks vLLM's wire (engine/vllm/) names no route outside
ROUTES. Skipped, saying why, where vLLM is not installed (failed under
MEGATRON_FR_REQUIRE_VLLM=1, tests/vllm/conftest.py)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from megatron_fr.engine import server_info
from megatron_fr.engine.sglang import protocol
from megatron_fr.engine.vllm import launch, wire

pytestmark = pytest.mark.vllm
REPO = Path(__file__).resolve().parents[2]
VLLM_SIDE = sorted((REPO / "megatron_fr/engine/vllm").glob("*.py"))


@pytest.fixture(scope="module")
def vllm_root(vllm_python: str) -> Path:
    root = launch.installed_source()
    assert root is not None, f"{vllm_python} has no vllm package"
    return root


def vllm_routes(root: Path) -> dict[str, set[str]]:
    """{path: methods} of every `@router.<method>("/path")` / `@app.<method>` decorator with a
    literal path in vLLM's entrypoints."""
    routes: dict[str, set[str]] = {}
    for path in sorted((root / "entrypoints").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.AsyncFunctionDef | ast.FunctionDef):
                continue
            for decorator in node.decorator_list:
                call = decorator if isinstance(decorator, ast.Call) else None
                method = getattr(call.func, "attr", None) if call else None
                if call is None or method not in ("get", "post", "put", "delete"):
                    continue
                if call.args and isinstance(call.args[0], ast.Constant):
                    routes.setdefault(call.args[0].value, set()).add(method.upper())
    return routes


def class_fields(source: str, name: str) -> set[str]:
    """The annotated attributes of class `name` in `source`."""
    node = next(
        n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef) and n.name == name
    )
    return {
        stmt.target.id
        for stmt in node.body
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
    }


def test_the_route_reader_finds_known_routes(vllm_root: Path) -> None:
    routes = vllm_routes(vllm_root)
    assert routes["/v1/completions"] == {"POST"} and routes["/health"] == {"GET"}
    assert "/get_weight_version" not in routes  # what SGLang-minded code might call


def test_every_route_the_wire_calls_is_a_vllm_route_with_its_method(vllm_root: Path) -> None:
    routes = vllm_routes(vllm_root)
    for path, method in wire.ROUTES.items():
        assert method in routes.get(path, set()), (path, method, routes.get(path))


def test_generate_requests_use_vllms_field_names(vllm_root: Path) -> None:
    request_fields = class_fields(
        (vllm_root / "entrypoints/scale_out/token_in_token_out/protocol.py").read_text(),
        "GenerateRequest",
    )
    sampling_fields = class_fields((vllm_root / "sampling_params.py").read_text(), "SamplingParams")
    sampling = protocol.SamplingParams(temperature=0.7, max_new_tokens=4, sampling_seed=1)
    body = wire.generate_request([1, 2], sampling, rid="r")
    assert set(body) <= request_fields, set(body) - request_fields
    params = body["sampling_params"]
    assert isinstance(params, dict)
    assert set(params) <= sampling_fields, set(params) - sampling_fields


def test_server_info_reads_fields_of_vllms_parallel_config(vllm_root: Path) -> None:
    fields = class_fields((vllm_root / "config/parallel.py").read_text(), "ParallelConfig")
    read = {"tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"}
    assert read <= fields, read - fields
    source = Path(server_info.__file__).read_text()
    assert all(f'"{name}"' in source for name in read)


def test_the_pause_modes_sent_are_vllms(vllm_root: Path) -> None:
    tree = ast.parse((vllm_root / "v1/engine/__init__.py").read_text())
    literal = next(
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "PauseMode"
    )
    assert isinstance(literal, ast.Subscript) and isinstance(literal.slice, ast.Tuple)
    modes = {element.value for element in literal.slice.elts if isinstance(element, ast.Constant)}
    assert set(wire.PAUSE_MODES.values()) <= modes, modes


def test_the_vllm_side_names_only_routes_in_the_table() -> None:
    """Every "/route" string constant of the code speaking vLLM's wire is in wire.ROUTES (so
    the route test above covers every call), apart from generate's body keys."""
    named = {
        node.value.split("?")[0]
        for path in VLLM_SIDE
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and node.value.startswith("/")
        and " " not in node.value
    }
    assert named <= set(wire.ROUTES), named - set(wire.ROUTES)
