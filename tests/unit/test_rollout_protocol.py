"""SGLang wire format: sampling keys and the fields the CPU engine accepts checked against
SGLang's own types (read from the installed source with `ast`; importing sglang fails without
its dependencies; request bodies against their routes' types are test_engine_contract.py's),
the strict /generate response parser checked against well-formed and malformed bodies, and
the per-token weight-version spans and top-K rows checked against SGLang's own code (run from
the installed source)."""

from __future__ import annotations
import __future__

import ast
import contextlib
import copy
import importlib.util
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError

from megatron_fr.engine.sglang import protocol as p
from megatron_fr.engine.sglang.protocol import MalformedResponse, SamplingParams


def _sglang_root() -> Path:
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("sglang is not installed (pip install --no-deps sglang==0.5.23)")
    return Path(next(iter(spec.submodule_search_locations)))


def _has_default(value: ast.expr | None) -> bool:
    """An annotated class attribute has a default unless it is bare or `field()` without
    default/default_factory."""
    if value is None:
        return False
    if isinstance(value, ast.Call) and getattr(value.func, "id", None) == "field":
        return any(kw.arg in ("default", "default_factory") for kw in value.keywords)
    return True


def class_fields(source: str) -> dict[str, dict[str, bool]]:
    """{class name: {field name: has_default}} for the classes defined at top level of `source`,
    including fields inherited from base classes defined in the same file."""
    classes = {n.name: n for n in ast.parse(source).body if isinstance(n, ast.ClassDef)}

    def fields(name: str) -> dict[str, bool]:
        node = classes[name]
        out: dict[str, bool] = {}
        for base in node.bases:
            if isinstance(base, ast.Name) and base.id in classes:
                out.update(fields(base.id))
        for stmt in node.body:
            if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
                continue
            if "ClassVar" in ast.unparse(stmt.annotation):
                continue
            out[stmt.target.id] = _has_default(stmt.value)
        return out

    return {name: fields(name) for name in classes}


@pytest.fixture(scope="module")
def io_struct() -> dict[str, dict[str, bool]]:
    return class_fields((_sglang_root() / "srt/managers/io_struct.py").read_text())


def test_class_fields_parser_on_a_known_snippet() -> None:
    source = (
        "from dataclasses import dataclass, field\n"
        "class Base:\n    rid: str = None\n    tag: int\n"
        "@dataclass\nclass Req(Base):\n    a: int\n    b: int = field(default=1)\n"
        "    c: list = field(kw_only=True)\n    d: 'ClassVar[int]' = 3\n"
        "    def f(self): x: int = 1\n"
    )
    assert class_fields(source)["Req"] == {
        "rid": True,
        "tag": False,
        "a": False,
        "b": True,
        "c": False,
    }


SAMPLING = SamplingParams(temperature=0.7, max_new_tokens=16, stop_token_ids=[2, 7])


def test_sampling_params_keys_are_sglang_sampling_params() -> None:
    root = _sglang_root()
    internal = class_fields((root / "srt/sampling/sampling_params.py").read_text())
    # The HTTP contract gate (api/v1) rejects unknown sampling keys with a 400.
    contract = class_fields((root / "api/v1/api_types.py").read_text())
    keys = set(SAMPLING.to_json())
    assert keys <= set(internal["SamplingParams"]), keys - set(internal["SamplingParams"])
    assert keys <= set(contract["SamplingParams"]), keys - set(contract["SamplingParams"])


def _literal_defaults(source: str, cls: str) -> dict[str, object]:
    """{field: default} for the fields of `cls` whose default is a plain literal."""
    node = next(n for n in ast.parse(source).body if getattr(n, "name", None) == cls)
    defaults = {}
    for stmt in node.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.value:
            with contextlib.suppress(ValueError):
                defaults[stmt.target.id] = ast.literal_eval(stmt.value)
    return defaults


def test_the_cpu_engine_accepts_only_sglang_names_and_defaults(io_struct) -> None:
    """Every /generate and sampling field the CPU server accepts is one of SGLang's, and those
    it accepts only at their default hold SGLang's default (so no request means one thing on
    SGLang and another on the CPU engine)."""
    from megatron_fr.engine.cpu import wire as w
    from megatron_fr.engine.cpu.engine import Sampling

    generate = {*w.GENERATE_FIELDS, *w.GENERATE_IGNORED, *w.GENERATE_DEFAULT_ONLY}
    assert generate <= set(io_struct["GenerateReqInput"]), generate - set(
        io_struct["GenerateReqInput"]
    )
    source = (_sglang_root() / "srt/sampling/sampling_params.py").read_text()
    sglang = class_fields(source)["SamplingParams"]
    ours = {*Sampling.__dataclass_fields__, *w.SAMPLING_IGNORED, *w.SAMPLING_DEFAULT_ONLY}
    assert ours <= set(sglang), ours - set(sglang)
    defaults = _literal_defaults(source, "SamplingParams")
    assert {k: defaults[k] for k in w.SAMPLING_DEFAULT_ONLY} == w.SAMPLING_DEFAULT_ONLY
    engine = Sampling()
    for name in ("temperature", "top_p", "max_new_tokens", "ignore_eos", "sampling_seed"):
        assert getattr(engine, name) == defaults[name], name
    generate_defaults = _literal_defaults(
        (_sglang_root() / "srt/managers/io_struct.py").read_text(), "GenerateReqInput"
    )
    assert w.GENERATE_DEFAULT_ONLY["stream"] == generate_defaults["stream"]
    # the engine's defaults for the routed-experts fields are SGLang's
    assert generate_defaults["return_routed_experts"] is False
    assert generate_defaults["routed_experts_start_len"] == 0


def test_generate_request_body() -> None:
    assert p.generate_request([5, 6], SAMPLING, rid="x") == {
        "input_ids": [5, 6],
        "sampling_params": {
            "temperature": 0.7,
            "top_p": 1.0,
            "top_k": -1,
            "max_new_tokens": 16,
            "stop_token_ids": [2, 7],
        },
        "return_logprob": True,
        "logprob_start_len": -1,
        "return_routed_experts": False,
        "rid": "x",
    }
    batched = p.generate_request([[1], [2, 3]], SAMPLING)
    assert batched["input_ids"] == [[1], [2, 3]] and "rid" not in batched
    assert p.generate_request([5], SAMPLING, top_logprobs_num=8)["top_logprobs_num"] == 8
    with pytest.raises(ValueError, match="top_logprobs_num must be >= 0"):
        p.generate_request([5], SAMPLING, top_logprobs_num=-1)


@pytest.mark.parametrize(
    ("ids", "rid", "match"),
    [
        ([], None, "input_ids must be a non-empty"),
        ([1, -2], None, r"input_ids\[1\]"),
        ([[1], []], None, r"input_ids\[1\] must be a non-empty"),
        ([[1], [2]], ["only-one"], "rid has 1 ids for a batch of 2"),
        ([1, 2], ["a"], "rid must be a str for a single prompt"),
    ],
)
def test_generate_request_refuses_bad_input(ids, rid, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        p.generate_request(ids, SAMPLING, rid=rid)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"top_k": 0}, "top_k"),
        ({"top_k": -2}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"seed": 3}, "seed"),
    ],
)
def test_sampling_params_refuses_bad_values(kwargs: dict, field: str) -> None:
    with pytest.raises(ValidationError, match=field):
        SamplingParams(**{"max_new_tokens": 4, **kwargs})


def test_sampling_params_logprob_mismatch() -> None:
    assert SamplingParams(max_new_tokens=1).logprob_mismatch() is None
    assert SamplingParams(max_new_tokens=1, temperature=0.5).logprob_mismatch() is None
    assert "top_p" in SamplingParams(max_new_tokens=1, top_p=0.9).logprob_mismatch()
    assert "top_k" in SamplingParams(max_new_tokens=1, top_k=50).logprob_mismatch()
    assert "greedy" in SamplingParams(max_new_tokens=1, temperature=0.0).logprob_mismatch()


def test_control_bodies() -> None:
    assert p.update_weights_from_distributed_request(
        ["a", "b"], ["bfloat16", "float32"], [(2, 3), [4]], group_name="g", weight_version=7
    ) == {
        "names": ["a", "b"],
        "dtypes": ["bfloat16", "float32"],
        "shapes": [[2, 3], [4]],
        "group_name": "g",
        "flush_cache": True,
        "abort_all_requests": False,
        "weight_version": "7",
        "load_format": None,
    }
    assert p.init_weights_update_group_request("10.0.0.1", 29500, 1, 5, backend="gloo") == {
        "master_address": "10.0.0.1",
        "master_port": 29500,
        "rank_offset": 1,
        "world_size": 5,
        "group_name": "weight_update_group",
        "backend": "gloo",
    }
    assert p.update_weight_version_request("v9") == {
        "new_version": "v9",
        "abort_all_requests": False,
    }
    assert p.pause_generation_request() == {"mode": "abort"}


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: p.pause_generation_request("stop"), "pause mode"),
        (lambda: p.init_weights_update_group_request("h", 1, 0, 2), "rank_offset 0"),
        (
            lambda: p.update_weights_from_distributed_request(["a"], [], [[1]], group_name="g"),
            r"dtypes \(0\)",
        ),
        (
            lambda: p.update_weights_from_distributed_request(
                ["a"], ["torch.bfloat16"], [[1]], group_name="g"
            ),
            r"dtypes\[0\]",
        ),
        (lambda: p.update_weights_from_tensor_request([]), "serialized_named_tensors"),
    ],
)
def test_control_bodies_refuse_bad_input(build: Callable, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build()


def well_formed() -> dict:
    return {
        "text": "",
        "output_ids": [11, 12, 13],
        "meta_info": {
            "id": "r0",
            "finish_reason": {"type": "length", "length": 3},
            "prompt_tokens": 4,
            "completion_tokens": 3,
            "weight_version": "2",
            "weight_versions": [{"version": "2", "start": 0, "end": 3}],
            "output_token_logprobs": [[-0.5, 11, None], [-1.25, 12, None], [0.0, 13, "x"]],
        },
    }


def test_parse_accepts_a_well_formed_body() -> None:
    out = p.parse_generate_response(well_formed())
    assert out == p.GenerateOutput(
        output_ids=[11, 12, 13],
        output_logprobs=[-0.5, -1.25, 0.0],
        finish_reason="length",
        weight_version="2",
        token_versions=["2", "2", "2"],
        routed_experts=None,
        prompt_tokens=4,
    )


def test_parse_variants_sglang_sends() -> None:
    body = well_formed()
    meta = body["meta_info"]
    meta["weight_version"] = 3
    meta["routed_experts"] = "AAAA"
    del meta["prompt_tokens"]  # the abort path of SGLang's tokenizer manager omits it
    meta["weight_versions"] = [
        {"version": "1", "start": 0, "end": 2},
        {"version": "3", "start": 2, "end": 3},
    ]
    out = p.parse_generate_response(body)
    assert out.weight_version == "3" and out.prompt_tokens is None
    assert out.token_versions == ["1", "1", "3"]
    assert out.routed_experts == "AAAA"

    empty_abort = {
        "output_ids": [],
        "meta_info": {
            "finish_reason": {"type": "abort", "message": "Abort in waiting queue"},
            "weight_version": "1",
            "output_token_logprobs": [],
        },
    }
    out = p.parse_generate_response(empty_abort)
    assert (out.output_ids, out.finish_reason, out.token_versions) == ([], "abort", [])


def _set(path: tuple, value: object) -> Callable[[dict], None]:
    def mutate(body: dict) -> None:
        target = body
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value

    return mutate


def _delete(path: tuple) -> Callable[[dict], None]:
    def mutate(body: dict) -> None:
        target = body
        for key in path[:-1]:
            target = target[key]
        del target[path[-1]]

    return mutate


LP = ("meta_info", "output_token_logprobs")
SPAN2 = {"version": "2", "start": 0, "end": 3}
MALFORMED: list[tuple[str, Callable[[dict], None], str]] = [
    ("missing output_ids", _delete(("output_ids",)), "output_ids"),
    ("output_ids not a list", _set(("output_ids",), "11 12 13"), "output_ids"),
    ("output id not an int", _set(("output_ids", 1), 12.0), "output_ids[1]"),
    ("output id a bool", _set(("output_ids", 0), True), "output_ids[0]"),
    ("missing meta_info", _delete(("meta_info",)), "meta_info"),
    ("missing logprobs", _delete(LP), "meta_info.output_token_logprobs"),
    (
        "wrong length",
        lambda b: b["meta_info"]["output_token_logprobs"].pop(),
        "meta_info.output_token_logprobs",
    ),
    ("entry arity", _set((*LP, 1), [-1.0, 12]), "meta_info.output_token_logprobs[1]"),
    ("token id mismatch", _set((*LP, 2, 1), 99), "meta_info.output_token_logprobs[2][1]"),
    ("positive logprob", _set((*LP, 1, 0), 0.25), "meta_info.output_token_logprobs[1][0]"),
    ("NaN logprob", _set((*LP, 0, 0), math.nan), "meta_info.output_token_logprobs[0][0]"),
    ("-inf logprob", _set((*LP, 2, 0), -math.inf), "meta_info.output_token_logprobs[2][0]"),
    ("string logprob", _set((*LP, 0, 0), "-0.5"), "meta_info.output_token_logprobs[0][0]"),
    ("text not a string", _set((*LP, 1, 2), 5), "meta_info.output_token_logprobs[1][2]"),
    ("finish_reason null", _set(("meta_info", "finish_reason"), None), "meta_info.finish_reason"),
    ("finish_reason missing", _delete(("meta_info", "finish_reason")), "meta_info.finish_reason"),
    (
        "finish_reason a string",
        _set(("meta_info", "finish_reason"), "stop"),
        "meta_info.finish_reason",
    ),
    (
        "bad finish_reason type",
        _set(("meta_info", "finish_reason", "type"), "cancelled"),
        "meta_info.finish_reason.type",
    ),
    (
        "missing weight_version",
        _delete(("meta_info", "weight_version")),
        "meta_info.weight_version",
    ),
    (
        "float weight_version",
        _set(("meta_info", "weight_version"), 1.5),
        "meta_info.weight_version",
    ),
    ("negative prompt_tokens", _set(("meta_info", "prompt_tokens"), -1), "meta_info.prompt_tokens"),
    *[
        (f"version spans: {case}", _set(("meta_info", "weight_versions"), spans), path)
        for case, spans, path in [
            ("missing", None, "meta_info.weight_versions"),
            ("not a list", {"version": "2", "start": 0, "end": 3}, "meta_info.weight_versions"),
            ("empty", [], "meta_info.weight_versions"),
            ("a list span", [["2", 0, 3]], "meta_info.weight_versions[0]"),
            ("extra key", [{**SPAN2, "x": 1}], "meta_info.weight_versions[0]"),
            ("int version", [{**SPAN2, "version": 2}], "meta_info.weight_versions[0].version"),
            ("bool start", [{**SPAN2, "start": False}], "meta_info.weight_versions[0].start"),
            ("start not 0", [{**SPAN2, "start": 1}], "meta_info.weight_versions[0].start"),
            ("float end", [{**SPAN2, "end": 3.0}], "meta_info.weight_versions[0].end"),
            ("end past the tokens", [{**SPAN2, "end": 4}], "meta_info.weight_versions[0].end"),
            ("too short", [{**SPAN2, "end": 2}], "meta_info.weight_versions"),
            (
                "a gap",
                [{"version": "1", "start": 0, "end": 1}, {"version": "2", "start": 2, "end": 3}],
                "meta_info.weight_versions[1].start",
            ),
            (
                "an empty span",
                [{"version": "1", "start": 0, "end": 0}, SPAN2],
                "meta_info.weight_versions[0].end",
            ),
            (
                "weight_version is not the last span's",
                [SPAN2 | {"end": 2}, {"version": "3", "start": 2, "end": 3}],
                "meta_info.weight_version",
            ),
        ]
    ],
]


@pytest.mark.parametrize(("case", "mutate", "path"), MALFORMED, ids=[c for c, _, _ in MALFORMED])
def test_parse_rejects_malformed_body(case: str, mutate: Callable, path: str) -> None:
    body = copy.deepcopy(well_formed())
    mutate(body)
    with pytest.raises(MalformedResponse) as info:
        p.parse_generate_response(body)
    assert info.value.path == path, (case, str(info.value))
    assert f": {path}: " in str(info.value)


def test_parse_rejects_non_object_and_names_the_server() -> None:
    with pytest.raises(MalformedResponse, match="response: expected a JSON object"):
        p.parse_generate_response([well_formed()])
    err = MalformedResponse("output_ids", "missing").from_server("http://h:1")
    assert isinstance(err, ValueError)
    assert str(err) == "malformed /generate response from http://h:1: output_ids: missing"


def test_parse_batched_responses_prefix_the_index() -> None:
    good, bad = well_formed(), well_formed()
    bad["meta_info"]["output_token_logprobs"][0][1] = 12
    assert len(p.parse_generate_responses([good, good], 2)) == 2
    with pytest.raises(MalformedResponse) as info:
        p.parse_generate_responses([good, bad], 2)
    assert info.value.path == "[1].meta_info.output_token_logprobs[0][1]"
    with pytest.raises(MalformedResponse, match="has 1 responses for 2 prompts"):
        p.parse_generate_responses([good], 2)


# --- per-token weight versions: SGLang's own span code, run from the installed source ---------


@dataclass
class _Span:
    """Stands for SGLang's msgspec WeightVersionSpan (msgspec is not installed): same fields."""

    version: str
    start: int
    end: int


@dataclass(frozen=True)
class _Event:
    old_version: str
    num_output_tokens: int


@pytest.fixture(scope="module")
def sglang_spans() -> dict[str, Callable]:
    """compute_weight_version_spans and add_weight_versions_to_meta_info exactly as written in
    the installed srt/utils/weight_versions.py (the module imports msgspec, absent here, so the
    two functions are cut out with `ast` and executed alone)."""
    source = (_sglang_root() / "srt/utils/weight_versions.py").read_text()
    wanted = {"compute_weight_version_spans", "add_weight_versions_to_meta_info"}
    functions = [n for n in ast.parse(source).body if getattr(n, "name", None) in wanted]
    assert {f.name for f in functions} == wanted, "SGLang's span functions moved"
    namespace: dict = {"WeightVersionSpan": _Span}
    module = ast.Module(body=functions, type_ignores=[])
    exec(
        compile(module, "weight_versions.py", "exec", flags=__future__.annotations.compiler_flag),
        namespace,
    )
    return namespace


def _random_generation(rng: random.Random) -> tuple[list[str], list[_Event], str]:
    """A request's life as SGLang's scheduler records it: tokens produced under the current
    label, label changes at random points (several in a row, before the first token, after
    the last), an event per change once the request has output (record_weight_version_events).
    Returns (the version of each token, the events, the label when it finished)."""
    label, versions, events = "v0", [], []
    for step in range(rng.randint(0, 12)):
        while rng.random() < 0.3:
            if versions:
                events.append(_Event(label, len(versions)))
            label = f"v{step}.{rng.randint(0, 9)}"
        versions.append(label)
    if rng.random() < 0.3:
        events.append(_Event(label, len(versions)) if versions else None)
        label = "final"
    return versions, [e for e in events if e is not None], label


def test_spans_as_sglang_writes_them_parse_to_the_version_of_every_token(sglang_spans) -> None:
    rng = random.Random(0)
    for _ in range(300):
        versions, events, label = _random_generation(rng)
        spans = sglang_spans["compute_weight_version_spans"](events, label, len(versions))
        meta = {"weight_version": "stale"}
        sglang_spans["add_weight_versions_to_meta_info"](meta, spans, len(versions))
        body = copy.deepcopy(well_formed())
        body["output_ids"] = list(range(len(versions)))
        body["meta_info"]["output_token_logprobs"] = [[-1.0, i, None] for i in body["output_ids"]]
        body["meta_info"] |= meta
        out = p.parse_generate_response(body)
        assert out.token_versions == versions, (versions, meta)
        assert out.weight_version == (versions[-1] if versions else label)


def test_the_cpu_engine_writes_spans_exactly_as_sglang(sglang_spans) -> None:
    from megatron_fr.engine.cpu.engine import Output
    from megatron_fr.engine.cpu.wire import generate_response

    rng = random.Random(1)
    for _ in range(300):
        versions, events, label = _random_generation(rng)
        spans = sglang_spans["compute_weight_version_spans"](events, label, len(versions))
        expected: dict = {}
        sglang_spans["add_weight_versions_to_meta_info"](expected, spans, len(versions))
        ids = list(range(len(versions)))
        output = Output(ids, [-1.0] * len(ids), {"type": "length"}, label, 3, versions)
        meta = generate_response(output, "r", None)["meta_info"]
        got = {key: meta[key] for key in ("weight_version", "weight_versions")}
        assert got == expected, (versions, events, label)


# --- top-K log-probs: SGLang's own answer code, run from the installed source -----------------

TOKENIZER_MANAGER = "srt/managers/tokenizer_manager.py"


@pytest.fixture(scope="module")
def sglang_logprob_meta() -> Callable:
    """TokenizerManager.add_logprob_to_meta_info as written in the installed
    tokenizer_manager.py, with the detokenize methods it calls, run on a finished request's
    state (no flat arrays, no text): the log-prob part of SGLang's meta_info for output tokens
    and their top-K as its scheduler hands them over, through JSON as the client gets it."""
    import functools
    import json
    import logging
    from types import SimpleNamespace

    from megatron_fr.engine.sglang.source import exec_function, function_source

    names = (
        "add_logprob_to_meta_info",
        "detokenize_logprob_tokens",
        "detokenize_top_logprobs_tokens",
    )
    namespace = {"logger": logging.getLogger("sglang")}
    methods = {
        name: exec_function(
            function_source(TOKENIZER_MANAGER, name, "TokenizerManager"), name, namespace
        )
        for name in names
    }
    manager = SimpleNamespace()
    for name in names[1:]:
        setattr(manager, name, functools.partial(methods[name], manager))

    def meta(ids: list[int], top: list[tuple[list[float], list[int]]], k: int) -> dict:
        obj = SimpleNamespace(
            return_flat_raw_top_logprobs=False, return_flat_raw_output_top_logprobs=False
        )
        state = SimpleNamespace(
            obj=obj,
            **{
                f"{side}_{kind}{part}": []
                for side in ("input", "output")
                for kind in ("token_logprobs", "top_logprobs")
                for part in ("", "_val", "_idx")
            },
        )
        state.output_token_logprobs_val = [values[0] if values else -1.0 for values, _ in top]
        state.output_token_logprobs_idx = list(ids)
        state.output_top_logprobs_val = [values for values, _ in top]
        state.output_top_logprobs_idx = [tokens for _, tokens in top]
        out: dict = {}
        methods["add_logprob_to_meta_info"](manager, out, state, k, None, False, finished=True)
        return json.loads(json.dumps(out))

    return meta


def _random_top(rng: random.Random, count: int, k: int) -> tuple[list[int], list]:
    """`count` output tokens, each the most likely of a random top-k (descending log-probs)."""
    top = []
    for _ in range(count):
        tokens = rng.sample(range(1000), k)
        values = sorted((math.log(rng.random() / k) for _ in range(k)), reverse=True)
        top.append((values, tokens))
    return [tokens[0] for _, tokens in top], top


def test_top_logprobs_as_sglang_writes_them_parse_to_each_tokens_ids_and_log_probs(
    sglang_logprob_meta,
) -> None:
    rng = random.Random(2)
    for count, k in [(0, 3), (1, 1), (5, 4), (9, 8)]:
        ids, top = _random_top(rng, count, k)
        body = well_formed()
        body["output_ids"] = ids
        body["meta_info"]["weight_versions"] = [{"version": "2", "start": 0, "end": count}]
        body["meta_info"] |= sglang_logprob_meta(ids, top, k)
        out = p.parse_generate_response(body, top_logprobs_num=k)
        assert out.top_logprobs.ids.tolist() == [tokens for _, tokens in top]
        assert out.top_logprobs.log_probs.shape == (count, k)
        expected = [[float(np.float32(v)) for v in values] for values, _ in top]
        assert out.top_logprobs.log_probs.tolist() == expected
        assert p.parse_generate_response(body).top_logprobs is None  # not asked: not read


def test_the_cpu_engine_writes_top_logprobs_exactly_as_sglang(sglang_logprob_meta) -> None:
    """Its answer and its waiting-queue abort answer carry SGLang's input_top_logprobs and
    output_top_logprobs for the same tokens."""
    from megatron_fr.engine.cpu.engine import Output
    from megatron_fr.engine.cpu.wire import generate_response

    rng = random.Random(3)
    for count, k in [(4, 3), (0, 2)]:
        ids, top = _random_top(rng, count, k)
        output = Output(ids, [values[0] for values, _ in top], {"type": "length"}, "1", 3)
        output.top_logprobs = top
        output.waiting_abort = count == 0
        meta = generate_response(output, "r", None)["meta_info"]
        expected = sglang_logprob_meta(ids, top, k)
        for key in ("input_top_logprobs", "output_top_logprobs", "output_token_logprobs"):
            assert meta[key] == expected[key], (key, count)


@pytest.fixture(scope="module")
def sglang_flat_layout() -> Callable:
    """flat_top_logprobs_layout as written in the installed io_struct.py: SGLang's rule for
    which rows of top log-probs may be null (it raises on any other)."""
    from megatron_fr.engine.sglang.source import exec_function, function_source

    name = "flat_top_logprobs_layout"
    return exec_function(function_source("srt/managers/io_struct.py", name), name, {})


def test_null_top_logprobs_rows_parse_where_sglangs_own_layout_allows_them(
    sglang_logprob_meta, sglang_flat_layout
) -> None:
    """Random rows emptied (SGLang writes null for an empty row): the parser accepts exactly
    the answers SGLang's flat layout accepts (nulls only in a leading run), reports that run's
    length as SGLang does, keeps the rows after it, and names the first null after a row."""
    rng = random.Random(4)
    accepted = refused = 0
    for _ in range(200):
        count, k = rng.randint(1, 6), rng.randint(1, 4)
        ids, top = _random_top(rng, count, k)
        top = [([], []) if rng.random() < 0.3 else row for row in top]
        body = well_formed()
        body["output_ids"] = ids
        body["meta_info"]["weight_versions"] = [{"version": "2", "start": 0, "end": count}]
        body["meta_info"] |= sglang_logprob_meta(ids, top, k)
        try:
            null_prefix, _ = sglang_flat_layout([values for values, _ in top], k)
        except ValueError:
            first = next(i for i, (values, _) in enumerate(top) if values)
            interior = next(i for i in range(first, count) if not top[i][0])
            with pytest.raises(MalformedResponse) as info:
                p.parse_generate_response(body, top_logprobs_num=k)
            assert info.value.path == f"meta_info.output_top_logprobs[{interior}]"
            refused += 1
            continue
        out = p.parse_generate_response(body, top_logprobs_num=k)
        assert out.top_logprobs_from == null_prefix
        assert out.top_logprobs.ids.tolist() == [tokens for _, tokens in top[null_prefix:]]
        accepted += 1
    assert accepted > 50 and refused > 50, (accepted, refused)


TOP = ("meta_info", "output_top_logprobs")
AT = "meta_info.output_top_logprobs"
TWO_ROWS = [[[-0.5, 11, None], [-2.0, 12, None]]] * 2
MALFORMED_TOP: list[tuple[str, Callable[[dict], None], str]] = [
    ("missing", _delete(TOP), AT),
    ("a token short", _set(TOP, TWO_ROWS), AT),
    ("a null position", _set((*TOP, 1), None), f"{AT}[1]"),
    ("K - 1 entries", _set((*TOP, 2), [[-0.5, 13, None]]), f"{AT}[2]"),
    ("entry arity", _set((*TOP, 0, 1), [-1.0, 5]), f"{AT}[0][1]"),
    ("positive", _set((*TOP, 0, 0, 0), 0.5), f"{AT}[0][0][0]"),
    ("NaN", _set((*TOP, 1, 1, 0), math.nan), f"{AT}[1][1][0]"),
    ("-inf", _set((*TOP, 1, 1, 0), -math.inf), f"{AT}[1][1][0]"),
    ("a bool", _set((*TOP, 2, 0, 0), False), f"{AT}[2][0][0]"),
    ("negative id", _set((*TOP, 2, 1, 1), -3), f"{AT}[2][1][1]"),
    ("id past int32", _set((*TOP, 2, 1, 1), 2**31), f"{AT}[2][1][1]"),
    ("float id", _set((*TOP, 0, 1, 1), 7.0), f"{AT}[0][1][1]"),
]


@pytest.mark.parametrize(
    ("case", "mutate", "path"), MALFORMED_TOP, ids=[c for c, _, _ in MALFORMED_TOP]
)
def test_parse_rejects_malformed_top_logprobs(case: str, mutate: Callable, path: str) -> None:
    body = copy.deepcopy(well_formed())
    body["meta_info"]["output_top_logprobs"] = [
        [[-0.5, token, None], [-2.0, token + 1, None]] for token in body["output_ids"]
    ]
    assert p.parse_generate_response(copy.deepcopy(body), 2).top_logprobs.tokens == 3
    mutate(body)
    with pytest.raises(MalformedResponse) as info:
        p.parse_generate_response(body, 2)
    assert info.value.path == path, (case, str(info.value))
