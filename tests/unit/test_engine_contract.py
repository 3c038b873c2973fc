"""The HTTP contract with SGLang, read from the installed sglang's source (never imported):
every endpoint the project calls, found in the code itself, is a route of SGLang's HTTP server
(srt/entrypoints/http_server.py, its `@app.*` decorators) with the method it is called with;
every body a protocol builder makes is SGLang's request type for that route (the type the
route's handler takes, io_struct.py); the CPU engine serves only SGLang's routes, and its
/model_info answers with SGLang's fields.

The calls are collected with `ast` from megatron_fr/ and tools/: every call of the project's
HTTP helpers (engine/http.py: get_json sends GET, post_json POST) and of an aiohttp session's
or urllib's get/post on `url + path`, through any function that passes its own path
parameter on to one of them (post_all, SGLangWire.pause, ...), with the path resolved to
its string (a literal, a module constant, a local assigned one). A call whose path cannot be
resolved fails the test, so a new call cannot slip past the contract."""

from __future__ import annotations

import ast
import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache, partial
from pathlib import Path

import pytest
from agent_fixtures import ScriptedEngine, build_tokenizer, serving
from test_rollout_protocol import SAMPLING, _sglang_root, class_fields

from megatron_fr.engine import http as engine_http
from megatron_fr.engine.cpu.server import CpuServer
from megatron_fr.engine.sglang import protocol as p
from megatron_fr.engine.sglang.source import SGLANG_VERSION

REPO = Path(__file__).resolve().parents[2]
VLLM_SIDE = (REPO / "megatron_fr/engine/vllm",)
"""Code that speaks vLLM's wire, not SGLang's: its routes are checked against vLLM's source
(tests/vllm/test_vllm_contract.py)."""
SCANNED = [
    path
    for path in [
        *sorted((REPO / "megatron_fr").rglob("*.py")),
        *sorted((REPO / "tools").rglob("*.py")),
    ]
    if not any(path == side or side in path.parents for side in VLLM_SIDE)
]
HTTP_SERVER = "srt/entrypoints/http_server.py"

HELPERS = {"get_json": ("GET", 1, "path"), "post_json": ("POST", 1, "path")}
"""engine/http.py's helpers: (method, index of the path argument, its name). Both go through
http._call, which sends a body (POST) exactly when post_json gives it one."""
SESSION_METHODS = {"get": "GET", "post": "POST", "put": "PUT", "delete": "DELETE", "urlopen": "GET"}
"""aiohttp's session.get(url + path) and the like; urllib's urlopen(url + path) sends GET."""

CPU_ONLY_ROUTES: dict[tuple[str, str], str] = {}
"""(method, path) the CPU engine serves although SGLang does not, each with the reason. Empty:
a route only the CPU engine has would let a test pass that fails against SGLang."""


@dataclass(frozen=True)
class Route:
    methods: frozenset[str]
    request_class: str | None
    """The type SGLang parses the body into: its handler's first parameter's annotation."""


def sglang_routes(source: str) -> dict[str, Route]:
    """{path: Route} of every `@app.get/post/put/delete(path)` and `@app.api_route(path,
    methods=[...])` decorator with a literal path."""
    routes: dict[str, Route] = {}
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.AsyncFunctionDef | ast.FunctionDef):
            continue
        for dec in node.decorator_list:
            if not (
                isinstance(dec, ast.Call)
                and isinstance(dec.func, ast.Attribute)
                and getattr(dec.func.value, "id", None) == "app"
                and dec.args
                and isinstance(dec.args[0], ast.Constant)
            ):
                continue
            if dec.func.attr == "api_route":
                listed = next(kw.value for kw in dec.keywords if kw.arg == "methods")
                methods = frozenset(ast.literal_eval(listed))
            else:
                methods = frozenset({dec.func.attr.upper()})
            path = dec.args[0].value
            known = routes.get(path, Route(frozenset(), None)).methods
            routes[path] = Route(known | methods, _request_class(node))
    return routes


def _request_class(handler: ast.AsyncFunctionDef | ast.FunctionDef) -> str | None:
    """`obj: X` or `obj: Annotated[X, Body()]` -> "X"; None for a handler without a body type."""
    if not handler.args.args:
        return None
    annotation = handler.args.args[0].annotation
    if isinstance(annotation, ast.Subscript) and getattr(annotation.value, "id", "") == "Annotated":
        annotation = annotation.slice.elts[0]  # type: ignore[attr-defined]
    name = getattr(annotation, "id", None)
    return None if name in (None, "Request") else name


@pytest.fixture(scope="module")
def routes() -> dict[str, Route]:
    return sglang_routes((_sglang_root() / HTTP_SERVER).read_text())


@pytest.fixture(scope="module")
def io_struct() -> dict[str, dict[str, bool]]:
    return class_fields((_sglang_root() / "srt/managers/io_struct.py").read_text())


def test_the_route_parser_on_a_known_snippet() -> None:
    source = (
        "@app.get('/a')\n@app.get('/b')\nasync def a(request: Request): ...\n"
        "@app.api_route('/c', methods=['GET', 'POST'])\n"
        "async def c(obj: Annotated[CReq, Body()], request: Request): ...\n"
        "@app.post('/d')\nasync def d(obj: DReq): ...\n"
        "@app.post(os.environ.get('X', '/e'))\nasync def e(): ...\n"
    )
    assert sglang_routes(source) == {
        "/a": Route(frozenset({"GET"}), None),
        "/b": Route(frozenset({"GET"}), None),
        "/c": Route(frozenset({"GET", "POST"}), "CReq"),
        "/d": Route(frozenset({"POST"}), "DReq"),
    }


# --- the calls the project makes ---------------------------------------------------------


@dataclass(frozen=True)
class Call:
    method: str
    path: str
    where: str


class _Module:
    """One scanned file: its string constants and what its imported names stand for."""

    def __init__(self, path: Path) -> None:
        self.path, self.tree = path, ast.parse(path.read_text())
        self.constants: dict[str, str] = {}
        self.imported: dict[str, tuple[str, str]] = {}
        """alias -> (module, name) of each `from module import name [as alias]`."""
        for node in self.tree.body:
            value = getattr(node, "value", None)
            if isinstance(node, ast.Assign | ast.AnnAssign) and isinstance(value, ast.Constant):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    if isinstance(target, ast.Name) and isinstance(value.value, str):
                        self.constants[target.id] = value.value
        for node in ast.walk(self.tree):  # imports inside functions too
            if isinstance(node, ast.ImportFrom) and node.module:
                for alias in node.names:
                    self.imported[alias.asname or alias.name] = (node.module, alias.name)

    def constant(self, name: str) -> str | None:
        if name in self.constants:
            return self.constants[name]
        if name in self.imported:
            module, attribute = self.imported[name]
            return _module_constant(module, attribute)
        return None

    def module_constant(self, module_name: str, attribute: str) -> str | None:
        if module_name not in self.imported:
            return None
        package, name = self.imported[module_name]
        return _module_constant(f"{package}.{name}", attribute)


@cache
def _module(path: Path) -> _Module:
    return _Module(path)


def _module_constant(module: str, name: str) -> str | None:
    path = REPO / (module.replace(".", "/") + ".py")
    return _module(path).constants.get(name) if path.exists() else None


def _functions(tree: ast.AST) -> Iterator[ast.FunctionDef | ast.AsyncFunctionDef]:
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node


def _callee(node: ast.expr) -> str | None:
    """The called name: `f` of f(..) and of x.f(..)."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _parameters(function: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    """Positional parameters as callers count them (a method's self or cls left out)."""
    names = [a.arg for a in (*function.args.posonlyargs, *function.args.args)]
    return names[1:] if names[:1] in (["self"], ["cls"]) else names


def _http_calls(
    node: ast.Call, senders: dict[str, tuple[str, int, str]]
) -> Iterator[tuple[str, ast.expr]]:
    """(method, path expression) of each HTTP call `node` makes: a call of a sender (helper
    or wrapper), also one handed to another function (pool.submit(post_json, url, path, ..),
    asyncio.to_thread(get_json, ..)), and session.get(url + path) / urlopen(url + path)."""
    callee = _callee(node.func)
    args, keywords = list(node.args), {kw.arg: kw.value for kw in node.keywords}
    for i, arg in enumerate(node.args):
        if _callee(arg) in senders:  # handed on: its arguments follow it
            callee, args = _callee(arg), list(node.args[i + 1 :])
            break
    if callee in senders:
        method, index, name = senders[callee]
        path = args[index] if index < len(args) else keywords.get(name)
        if path is not None:
            yield method, path
    elif callee in SESSION_METHODS and node.args and isinstance(node.args[0], ast.BinOp):
        joined = node.args[0]
        if isinstance(joined.op, ast.Add):
            yield SESSION_METHODS[callee], joined.right


WIRE_PATHS = (
    "generate_path",
    "version_path",
    "join_group_path",
    "receive_path",
    "leave_group_path",
    "tensor_path",
)
"""The engine interface's path attributes (engine/wire.py): `x.generate_path` is resolved to
the SGLang implementation's (engine/sglang/wire.py), what the scanned code speaks to SGLang."""
SGLANG_WIRE = REPO / "megatron_fr/engine/sglang/wire.py"


def _wire_path(attribute: str) -> set[str] | None:
    module = _module(SGLANG_WIRE)
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == attribute for t in node.targets
        ):
            found = _resolve(node.value, module, None)
            return found if isinstance(found, set) else None
    return None


def _returned_path(module: _Module, call: ast.expr, index: int) -> set[str] | str | None:
    """Element `index` of what `self.method(..)` returns, for a method of the same module that
    returns a tuple (a transport's `path, body = self.update_request(..)`)."""
    if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)):
        return None
    method = next((f for f in _functions(module.tree) if f.name == call.func.attr), None)
    returns = [n.value for n in ast.walk(method) if isinstance(n, ast.Return)] if method else []
    values = [
        _resolve(value.elts[index], module, method)
        for value in returns
        if isinstance(value, ast.Tuple) and len(value.elts) > index
    ]
    if values and all(isinstance(v, set) for v in values):
        return set().union(*values)  # type: ignore[arg-type]
    return None


def _resolve(
    expr: ast.expr, module: _Module, function: ast.FunctionDef | ast.AsyncFunctionDef | None
) -> set[str] | str | None:
    """The path strings `expr` can be; the parameter's name when it is one of `function`'s;
    None when it cannot be told."""
    if isinstance(expr, ast.Constant) and isinstance(expr.value, str):
        return {expr.value}
    if isinstance(expr, ast.Attribute) and expr.attr in WIRE_PATHS:
        return _wire_path(expr.attr)
    if isinstance(expr, ast.BinOp) and isinstance(expr.op, ast.Add):  # path + "?query"
        query = _resolve(expr.right, module, function)
        if isinstance(query, set) and all(q.startswith("?") for q in query):
            return _resolve(expr.left, module, function)
        return None
    if isinstance(expr, ast.Starred):  # post(*self.join_requests(..)): the path comes first
        return _returned_path(module, expr.value, 0)
    if isinstance(expr, ast.Attribute) and isinstance(expr.value, ast.Name):
        value = module.module_constant(expr.value.id, expr.attr)
        return {value} if value is not None else None
    if not isinstance(expr, ast.Name):
        return None
    if function is not None:
        if expr.id in _parameters(function):
            return expr.id
        for stmt in ast.walk(function):  # path, body = self.update_request(..)
            if isinstance(stmt, ast.Assign) and isinstance(stmt.targets[0], ast.Tuple):
                names = [getattr(t, "id", None) for t in stmt.targets[0].elts]
                if expr.id in names:
                    return _returned_path(module, stmt.value, names.index(expr.id))
        assigned = [
            stmt.value
            for stmt in ast.walk(function)
            if isinstance(stmt, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == expr.id for t in stmt.targets)
        ]
        if assigned:
            values = [_resolve(value, module, None) for value in assigned]
            if all(isinstance(v, set) for v in values):
                return set().union(*values)  # type: ignore[arg-type]
            return None
    value = module.constant(expr.id)
    return {value} if value is not None else None


def project_calls() -> tuple[list[Call], list[str]]:
    """Every (method, path) the project calls, and the calls whose path could not be told."""
    senders = dict(HELPERS)
    while True:  # functions passing their path parameter on are senders too, to a fixpoint
        found = dict(senders)
        for path in SCANNED:
            module = _module(path)
            for function in _functions(module.tree):
                if function.name in HELPERS:
                    continue
                for node in ast.walk(function):
                    if not isinstance(node, ast.Call):
                        continue
                    for method, expr in _http_calls(node, senders):
                        name = _resolve(expr, module, function)
                        if isinstance(name, str):
                            index = _parameters(function).index(name)
                            found.setdefault(function.name, (method, index, name))
        if found == senders:
            break
        senders = found
    calls, unresolved = [], []
    for path in SCANNED:
        module = _module(path)
        enclosing = {
            id(node): function
            for function in _functions(module.tree)
            for node in ast.walk(function)
            if function.name not in HELPERS
        }
        for node in ast.walk(module.tree):
            if not isinstance(node, ast.Call) or id(node) not in enclosing:
                continue
            function = enclosing[id(node)]
            where = f"{path.relative_to(REPO)}:{node.lineno}"
            for method, expr in _http_calls(node, senders):
                value = _resolve(expr, module, function)
                if isinstance(value, set):
                    calls += [Call(method, text, where) for text in value]
                elif value is None:
                    unresolved.append(f"{where}: {ast.unparse(expr)}")
    return calls, unresolved


def test_every_endpoint_the_project_calls_is_an_sglang_route_with_its_method(routes) -> None:
    calls, unresolved = project_calls()
    assert not unresolved, f"calls whose path the contract cannot tell: {unresolved}"
    called = {(call.method, call.path) for call in calls}
    # The scan sees the calls it must: each path constant is called, and the ways of calling.
    constants = {
        getattr(module, name)
        for module in (p, engine_http)
        for name in dir(module)
        if name.endswith("_PATH")
    }
    assert constants <= {path for _, path in called}, constants - {path for _, path in called}
    assert {
        ("GET", "/model_info"),  # aiohttp session, supervisor
        ("GET", "/health"),  # urlopen, launcher; aiohttp, client
        ("POST", "/generate"),  # aiohttp, client; post_json, tools/gpu_check.py
        ("POST", "/pause_generation"),  # WeightSync._pause -> SGLangWire.pause -> post_json
        ("POST", "/destroy_weights_update_group"),  # a local path -> _unless_absent
    } <= called
    wrong = sorted(
        f"{call.where}: {call.method} {call.path}"
        + (
            f" (SGLang: {sorted(routes[call.path].methods)})"
            if call.path in routes
            else " (no such route)"
        )
        for call in calls
        if call.method not in routes.get(call.path, Route(frozenset(), None)).methods
    )
    assert not wrong, f"calls sglang {SGLANG_VERSION} does not serve: {wrong}"


BUILDERS = [
    partial(p.generate_request, [1, 2, 3], SAMPLING, rid="r0"),
    partial(
        p.generate_request, [[1, 2], [3]], SAMPLING, rid=["a", "b"], routed_experts_start_len=1
    ),
    partial(p.generate_request, [1, 2, 3], SAMPLING, top_logprobs_num=8),
    partial(p.init_weights_update_group_request, "h", 29500, 1, 3),
    partial(
        p.update_weights_from_distributed_request,
        ["w"],
        ["bfloat16"],
        [[2, 3]],
        group_name="g",
        weight_version=4,
    ),
    partial(p.update_weights_from_disk_request, "/ckpt/step-4"),
    partial(p.update_weights_from_tensor_request, ["YWJj"], load_format="flattened_bucket"),
    partial(p.pause_generation_request, "retract"),
    partial(p.continue_generation_request),
    partial(p.update_weight_version_request, 5),
    partial(p.destroy_weights_update_group_request, "g"),
    partial(p.begin_weight_update_request),
    partial(p.end_weight_update_request),
    partial(p.get_weights_by_name_request, "w", 4),
]
"""A body of each builder in engine/sglang/protocol.py (each builder at least once)."""


@pytest.mark.parametrize("build", BUILDERS, ids=[build.func.__name__ for build in BUILDERS])
def test_every_protocol_body_is_the_request_type_of_its_route(routes, io_struct, build) -> None:
    """protocol.<route>_request builds the body of POST /<route>: its keys are fields of the
    type SGLang's handler of that route takes, with every field that has no default."""
    route = "/" + build.func.__name__.removesuffix("_request")
    assert route in routes and "POST" in routes[route].methods, route
    request_class = routes[route].request_class
    fields, body = io_struct[request_class], build()
    unknown = set(body) - set(fields)
    assert not unknown, f"{request_class} has no field(s) {sorted(unknown)}; has {sorted(fields)}"
    required = {name for name, has_default in fields.items() if not has_default}
    assert required <= set(body), f"{request_class} requires {sorted(required - set(body))}"


def test_every_protocol_builder_is_checked() -> None:
    builders = {name for name in dir(p) if name.endswith("_request") and callable(getattr(p, name))}
    assert {build.func.__name__ for build in BUILDERS} == builders


# --- the CPU engine -------------------------------------------------------------------------


def _model_info_fields(source: str) -> set[str]:
    """The keys of the dict SGLang's GET /model_info handler answers with."""
    handler = next(
        node
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.AsyncFunctionDef) and node.name == "model_info"
    )
    result = next(
        node.value
        for node in ast.walk(handler)
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "result"
    )
    assert isinstance(result, ast.Dict)
    return {key.value for key in result.keys if isinstance(key, ast.Constant)}


def cpu_engine_answer(engine: ScriptedEngine, path: str) -> dict:
    """The CPU engine's JSON answer to GET `path`, served over real HTTP."""

    async def get() -> dict:
        import aiohttp

        async with (
            serving(engine) as url,
            aiohttp.ClientSession() as session,
            session.get(url + path) as response,
        ):
            return await response.json()

    return asyncio.run(get())


def test_the_cpu_engine_serves_sglangs_routes_and_model_info(routes) -> None:
    engine = ScriptedEngine(build_tokenizer(), lambda conversation: "ok", weight_version="7")
    served = {
        (route.method, route.resource.canonical)
        for route in CpuServer(engine).app().router.routes()
        if route.method != "HEAD"  # aiohttp adds one to each GET
    }
    sglang = {(method, path) for path, route in routes.items() for method in route.methods}
    assert served - sglang == set(CPU_ONLY_ROUTES), sorted(served - sglang)

    answer = cpu_engine_answer(engine, engine_http.MODEL_INFO_PATH)
    sglang_fields = _model_info_fields((_sglang_root() / HTTP_SERVER).read_text())
    assert "weight_version" in sglang_fields
    assert set(answer) <= sglang_fields, set(answer) - sglang_fields
    assert answer["weight_version"] == "7"  # a string, as SGLang's server_args field


CPU_ONLY_SERVER_INFO = {
    "engine": "names the CPU engine (engine/server_info.py tells it from SGLang by this field)",
    "instance_id": "tells one CPU engine process reached under two URLs from two engines; "
    "SGLang has none, so SGLang engines are told apart by resolved address alone "
    "(rollout/supervisor.py), and nothing reads the field unless an engine sends it",
}
"""/server_info fields the CPU engine answers that SGLang's does not, each with the reason."""


def _server_args_fields() -> set[str]:
    """Every field of SGLang's ServerArgs records (srt/arg_groups/fields/*.py: annotated class
    attributes), which ServerArgs.resolved_dict puts in /server_info."""
    names: set[str] = set()
    for path in sorted((_sglang_root() / "srt/arg_groups/fields").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                names.update(
                    stmt.target.id
                    for stmt in node.body
                    if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                )
    return names


def test_the_cpu_engines_server_info_has_sglangs_fields_and_only_listed_extras() -> None:
    engine = ScriptedEngine(build_tokenizer(), lambda conversation: "ok", weight_version="7")
    answer = cpu_engine_answer(engine, engine_http.SERVER_INFO_PATH)
    sglang_fields = _server_args_fields()
    for read in ("tp_size", "pp_size", "dp_size", "attn_dp_size", "enable_return_routed_experts"):
        assert read in sglang_fields, read  # what engine/server_info.py reads of SGLang
    assert set(answer) - sglang_fields == set(CPU_ONLY_SERVER_INFO), set(answer) - sglang_fields
