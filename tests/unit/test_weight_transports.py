"""Weight transports against SGLang's own code (sglang 0.5.23, read from the installed
package): request bodies against its io_struct request types, the group's rank layout against
its WeightUpdater, the flattened bucket against its FlattenedTensorBucket, the tensor payloads
against BaseTpWorker.deserialize_own_rank, the disk layout against its loader's glob and
index filter; then engine discovery, cache flushing and the spot-check refusal on stand-in
HTTP servers."""

from __future__ import annotations

import ast
import base64
import contextlib
import fnmatch
import glob
import inspect
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from stub_server import StubServer
from test_rollout_protocol import class_fields

from megatron_fr.config.weights import WeightSyncConfig
from megatron_fr.engine import http as engine_http
from megatron_fr.engine.http import EngineRequestError, flush_cache
from megatron_fr.engine.server_info import CPU_ENGINE, ENGINE_FIELD, UnknownServer
from megatron_fr.engine.sglang import protocol
from megatron_fr.engine.sglang import source as src
from megatron_fr.engine.sglang.wire import SGLANG_WIRE
from megatron_fr.models.hf_config import SUPPORTED_MODEL_TYPES, load_hf_config
from megatron_fr.utils.net import address_towards
from megatron_fr.weights import sync as sync_module
from megatron_fr.weights.transports import distributed as dist_module
from megatron_fr.weights.transports import tensor as tensor_module
from megatron_fr.weights.transports.base import Engine, resolve_engine
from megatron_fr.weights.transports.disk import DiskTransport
from megatron_fr.weights.transports.distributed import (
    DistributedTransport,
    flatten_bucket,
    group_size,
)
from megatron_fr.weights.transports.tensor import TensorTransport

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def io_struct() -> dict[str, dict[str, bool]]:
    return class_fields((src.sglang_root() / "srt/managers/io_struct.py").read_text())


def assert_request_of(body: dict, request_class: str, io_struct) -> None:
    """Every key a field of SGLang's request type, every field without default present."""
    fields = io_struct[request_class]
    assert set(body) <= set(fields), set(body) - set(fields)
    assert {name for name, has_default in fields.items() if not has_default} <= set(body)


def mixed_bucket() -> list[tuple[str, torch.Tensor]]:
    return [
        ("a.weight", torch.arange(6, dtype=torch.float32).reshape(2, 3)),
        ("b.weight", torch.tensor([1.5, -2.0], dtype=torch.bfloat16)),
        ("c.weight", torch.ones(4, dtype=torch.float32)),
    ]


class Recorder:
    """Stands in for post_json / the process group: records what would be sent."""

    def __init__(self):
        self.posts: list[tuple[str, str, dict]] = []
        self.broadcasts: list[torch.Tensor] = []

    def post_json(self, url, path, body, timeout_s):
        self.posts.append((url, path, body))
        return {"success": True}

    def broadcast(self, tensor):
        self.broadcasts.append(tensor.clone())

    def destroy(self):
        pass


# --- the broadcast transport ------------------------------------------------------------------


def test_each_engine_has_a_group_of_its_own_sized_by_sglangs_rank_rule():
    source = src.function_source(src.WEIGHT_UPDATER, "init_weights_update_group", "WeightUpdater")
    assert "rank = rank_offset + self.tp_rank" in source  # SGLang's rule
    for tp in (1, 2, 4):  # the sender is rank 0; the engine's TP ranks 1..tp at offset 1
        engine = Engine("u", tp_size=tp)
        assert group_size(engine) == 1 + tp
        assert sorted(1 + rank for rank in range(tp)) == list(range(1, group_size(engine)))


def test_flattened_bucket_is_sglangs_layout_and_misaligned_buckets_go_tensor_by_tensor():
    bucket_class = src.flattened_tensor_bucket()
    flat = flatten_bucket(mixed_bucket())
    assert torch.equal(flat, bucket_class(named_tensors=mixed_bucket()).get_flattened_tensor())
    names = [n for n, _ in mixed_bucket()]
    dtypes = [dist_module.dtype_name(t) for _, t in mixed_bucket()]
    received = bucket_class.empty(names, dtypes, [list(t.shape) for _, t in mixed_bucket()], "cpu")
    received.get_flattened_tensor().copy_(flat)
    for (name, got), (_, sent) in zip(received.reconstruct_tensors(), mixed_bucket(), strict=True):
        assert got.dtype == sent.dtype and torch.equal(got, sent), name
    odd = [("x", torch.ones(3, dtype=torch.bfloat16)), ("y", torch.ones(2, dtype=torch.float32))]
    assert flatten_bucket(odd) is None
    with pytest.raises(ValueError, match="Unaligned"):  # why the fallback exists
        bucket_class.empty(["x", "y"], ["bfloat16", "float32"], [[3], [2]], "cpu")


class GroupRecorder(Recorder):
    """One group of the transport's: its broadcasts go to the shared record, tagged."""

    def __init__(self, shared: Recorder, name: str):
        super().__init__()
        self.shared, self.name = shared, name

    def broadcast(self, tensor):
        self.shared.posts.append(("", "broadcast", {"group": self.name}))
        self.shared.broadcasts.append(tensor.clone())

    def abort(self):
        pass


@pytest.mark.parametrize("flatten", [False, True])
def test_distributed_transport_requests_are_sglang_requests(flatten, monkeypatch, io_struct):
    """Each engine joins a group of its own (the sender rank 0, its TP ranks from 1), all of a
    stage's groups on the stage's one store; each bucket goes engine after engine, an engine's
    update call posted only when its turn comes, then the broadcasts on its group."""
    recorder, stores = Recorder(), []
    monkeypatch.setattr(dist_module, "post_json", recorder.post_json)
    monkeypatch.setattr(dist_module, "create_group_store", lambda *a: stores.append(a) or "store")
    monkeypatch.setattr(
        dist_module,
        "host_weight_update_group",
        lambda store, world, name, *a: GroupRecorder(recorder, name),
    )
    monkeypatch.setattr(dist_module, "address_towards", lambda host: "10.0.0.7")
    engines = [Engine(f"http://e{i}:1", tp_size=tp, kind="sglang") for i, tp in enumerate((2, 1))]
    transport = DistributedTransport(engines, "10.0.0.1", 29600, "nccl", flatten=flatten)
    transport.connect(stage=1)  # stage 1: its own port, groups and address
    assert [store[:2] for store in stores] == [("10.0.0.7", 29601)]  # one store for the stage
    inits = [
        (url, body) for url, path, body in recorder.posts if path == "/init_weights_update_group"
    ]
    for _, body in inits:
        assert_request_of(body, "InitWeightsUpdateGroupReqInput", io_struct)
    assert [(url, b["rank_offset"], b["world_size"], b["group_name"]) for url, b in inits] == [
        ("http://e0:1", 1, 3, "weight_update_group_pp1_e0"),
        ("http://e1:1", 1, 2, "weight_update_group_pp1_e1"),
    ]
    assert {(b["master_address"], b["master_port"]) for _, b in inits} == {("10.0.0.7", 29601)}
    assert transport.group_names(2) == [
        "weight_update_group_pp0_e0",
        "weight_update_group_pp0_e1",
        "weight_update_group_pp1_e0",
        "weight_update_group_pp1_e1",
    ]
    recorder.posts.clear()
    transport.send(mixed_bucket())
    per_engine = 1 if flatten else len(mixed_bucket())  # broadcasts per engine and bucket
    records = [
        (url, path, body.get("group_name", body.get("group"))) for url, path, body in recorder.posts
    ]
    groups = [group for _, _, group in records]
    assert groups == sorted(groups)  # engine e1's turn starts once e0's bucket is in
    for index, url in enumerate(["http://e0:1", "http://e1:1"]):
        group = f"weight_update_group_pp1_e{index}"
        mine = sorted(record for record in records if record[2] == group)
        broadcasts = [("", "broadcast", group)] * per_engine
        assert mine == sorted([(url, "/update_weights_from_distributed", group), *broadcasts])
    update = next(body for _, path, body in recorder.posts if path != "broadcast")
    assert_request_of(update, "UpdateWeightsFromDistributedReqInput", io_struct)
    assert update["flush_cache"] is False
    assert update["dtypes"] == ["float32", "bfloat16", "float32"]
    if flatten:  # one broadcast per bucket and engine
        assert update["load_format"] == "flattened_bucket"
        assert all(torch.equal(b, flatten_bucket(mixed_bucket())) for b in recorder.broadcasts)
    else:  # SGLang's default: tensor by tensor, in the order the request names them
        assert update["load_format"] is None
        sent = [tensor for _, tensor in mixed_bucket()] * 2
        assert all(torch.equal(a, b) for a, b in zip(recorder.broadcasts, sent, strict=True))
    recorder.posts.clear()
    transport.close()
    leaves = [(url, body) for url, _, body in recorder.posts]
    for _, body in leaves:
        assert_request_of(body, "DestroyWeightsUpdateGroupReqInput", io_struct)
    assert [(url, body["group_name"]) for url, body in leaves] == [
        ("http://e0:1", "weight_update_group_pp1_e0"),
        ("http://e1:1", "weight_update_group_pp1_e1"),
    ]
    transport.master_address = None
    assert transport.sender_address(0) == "10.0.0.7"  # no address configured: its own


def test_distributed_transport_refuses_engines_whose_ranks_would_collide():
    for engine in (
        Engine("http://x", 2, "sglang", pp_size=2),
        Engine("http://x", 2, "sglang", dp_replicas=2),
    ):
        with pytest.raises(ValueError, match="same rank"):
            DistributedTransport([engine], None, 1).check_engines()


# --- the tensor transport -----------------------------------------------------------------------


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_tensor_transport_sends_one_own_payload_per_sglang_tp_rank(tp_size, io_struct):
    serialized = []

    def serialize(bucket):
        serialized.append(bucket)
        return f"payload-{len(serialized) - 1}"

    engine = Engine("http://e:1", tp_size=tp_size, kind="sglang")
    body = TensorTransport([engine], 10.0, serialize).request_body(mixed_bucket(), engine)
    assert_request_of(body, "UpdateWeightsFromTensorReqInput", io_struct)
    payloads = body["serialized_named_tensors"]
    assert payloads == [f"payload-{i}" for i in range(tp_size)]  # a serialization each
    # Every SGLang TP rank reads its own payload (BaseTpWorker.deserialize_own_rank).
    source = src.function_source(
        "srt/managers/tp_worker.py", "deserialize_own_rank", "BaseTpWorker"
    )
    for tp_rank in range(tp_size):
        namespace = {
            "monkey_patch_torch_reductions": lambda: None,
            "MultiprocessingSerializer": SimpleNamespace(deserialize=lambda payload: payload),
            "get_parallel": lambda rank=tp_rank: SimpleNamespace(tp_rank=rank),
        }
        own = src.exec_function(source, "deserialize_own_rank", namespace)
        assert own(None, payloads) == f"payload-{tp_rank}"
    with pytest.raises(ValueError, match="tp_size unknown"):
        TensorTransport([Engine("http://e:1")], 1.0, serialize).request_body([], Engine("u"))


@pytest.fixture
def torch_reductions():
    """torch's tensor reductions, restored (and re-registered) after a test that patches them."""
    from torch.multiprocessing import reductions

    saved = {name: getattr(reductions, name) for name in ("reduce_tensor", "rebuild_cuda_tensor")}
    yield reductions
    for name in ("_reduce_tensor_original", "_rebuild_cuda_tensor_original"):
        if hasattr(reductions, name):
            delattr(reductions, name)
    for name, value in saved.items():
        setattr(reductions, name, value)
    reductions.init_reductions()


def test_tensor_transport_names_gpus_the_way_sglangs_receiver_reads_them(torch_reductions):
    """The sender patches torch with SGLang's own monkey_patch_torch_reductions (read from the
    installed package), the patch SGLang's receiver applies before it opens a payload
    (BaseTpWorker.deserialize_own_rank): torch's CUDA reduction then writes the device's UUID
    into the argument SGLang's rebuild maps back to a local index, and that argument is the
    `device` slot of torch's own CUDA reduction (read from torch's source here)."""
    receiver = src.function_source(
        "srt/managers/tp_worker.py", "deserialize_own_rank", "BaseTpWorker"
    )
    assert "monkey_patch_torch_reductions()" in receiver
    original = torch_reductions.reduce_tensor
    src.monkey_patch_torch_reductions()()
    assert torch_reductions.reduce_tensor.__name__ == "_reduce_tensor_modified"
    assert torch_reductions.rebuild_cuda_tensor.__name__ == "_rebuild_cuda_tensor_modified"
    tree = ast.parse(inspect.getsource(original))
    cuda = next(
        node.value.elts[1]
        for node in ast.walk(tree)
        if isinstance(node, ast.Return)
        and isinstance(node.value, ast.Tuple)
        and ast.unparse(node.value.elts[0]) == "rebuild_cuda_tensor"
    )
    slot = [ast.unparse(arg) for arg in cuda.elts].index("device")
    assert slot == src.module_constant(src.PATCH_TORCH, "_REDUCE_TENSOR_ARG_DEVICE_INDEX") == 6
    assert list(inspect.signature(original).parameters) == ["tensor"]


def test_tensor_transport_refuses_engines_off_this_node_and_machines_without_cuda(monkeypatch):
    here = ["127.0.0.1", "localhost", socket.gethostname()]
    with contextlib.suppress(OSError):  # this machine's own address, where it has a route
        here.append(address_towards("10.255.255.1"))
    TensorTransport([Engine(f"http://{host}:1", 1, "sglang") for host in here], 1.0).connect(0)
    for host in ("10.255.255.1", "no-such-host.invalid"):
        transport = TensorTransport([Engine(f"http://{host}:1", 1, "sglang")], 1.0)
        with pytest.raises(tensor_module.NotColocated, match=f"'{host}' is not this node"):
            transport.connect(0)
    if torch.cuda.is_available():
        return
    monkeypatch.setattr(tensor_module, "post_json", Recorder().post_json)
    transport = TensorTransport([Engine("http://127.0.0.1:1", tp_size=1, kind="sglang")], 1.0)
    before = torch.multiprocessing.reductions.reduce_tensor
    with pytest.raises(RuntimeError, match="this machine has no CUDA"):
        transport.send(mixed_bucket())
    assert torch.multiprocessing.reductions.reduce_tensor is before, "torch left unpatched"


RECEIVE_IN_ANOTHER_PROCESS = """
import base64, pickle, sys
from megatron_fr.engine.sglang import source as sglang_source
sglang_source.monkey_patch_torch_reductions()()  # as SGLang's receiver does
[(name, tensor)] = pickle.loads(base64.b64decode(sys.stdin.read()))
print(name, tensor.device, tensor.tolist())
"""


@pytest.mark.gpu
def test_tensor_transport_payload_carries_the_gpu_uuid_and_opens_in_another_process(
    torch_reductions,
):
    tensor = torch.arange(6.0, device="cuda").reshape(2, 3)
    payload = SGLANG_WIRE.tensor_serializer()([("w", tensor)])
    uuid = str(torch.cuda.get_device_properties(tensor.device).uuid)
    assert uuid.encode() in base64.b64decode(payload), "the handle names the GPU by UUID"
    received = subprocess.run(
        [sys.executable, "-c", RECEIVE_IN_ANOTHER_PROCESS],
        input=payload,
        text=True,
        capture_output=True,
        timeout=300,
        env=os.environ | {"PYTHONPATH": str(REPO)},
    )
    assert received.returncode == 0, received.stderr[-3000:]
    assert received.stdout.split(maxsplit=2) == ["w", "cuda:0", str(tensor.tolist())]


# --- the disk transport -------------------------------------------------------------------------


def sglang_weight_files(folder: Path) -> list[str]:
    """The files SGLang's DefaultModelLoader._prepare_weights loads from `folder` for the
    safetensors format: its glob, then its index filter (exec'd from weight_utils.py)."""
    loader = (src.sglang_root() / "srt/model_loader/loader.py").read_text()
    assert "glob.glob(os.path.join(hf_folder, pattern))" in loader
    filter_source = src.function_source(
        "srt/model_loader/weight_utils.py", "filter_duplicate_safetensors_files"
    )
    namespace = {"os": os, "json": json, "fnmatch": fnmatch}
    filter_files = src.exec_function(filter_source, "filter_duplicate_safetensors_files", namespace)
    files = glob.glob(os.path.join(str(folder), "*.safetensors"))
    return filter_files(files, str(folder), "model.safetensors.index.json")


def test_disk_layout_is_what_sglangs_loader_reads(tmp_path, monkeypatch, io_struct):
    recorder = Recorder()
    monkeypatch.setattr(
        engine_http,
        "post_json",
        lambda url, path, body, t: recorder.posts.append((url, path, body)),
    )
    engines = [Engine("http://e:1", tp_size=1, kind="sglang")]
    stages = [DiskTransport(engines, tmp_path), DiskTransport(engines, tmp_path)]
    (tmp_path / "stage-0").mkdir()  # a leftover of the old layout must not matter
    sent = {
        f"s{stage}.t{i}": torch.full((3,), stage * 10.0 + i) for stage in (0, 1) for i in range(3)
    }

    def sync(buckets_per_stage):
        for stage, transport in enumerate(stages):
            names = sorted(n for n in sent if n.startswith(f"s{stage}."))
            for chunk in buckets_per_stage[stage]:
                transport.send([(name, sent[name]) for name in names[chunk]])
            transport.finish_stage()
        stages[0].commit("3")
        loaded = {}
        for file in sglang_weight_files(tmp_path):
            loaded.update(load_file(file))
        return loaded

    for stage, transport in enumerate(stages):
        transport.connect(stage)
    loaded = sync([[slice(0, 1), slice(1, 3)], [slice(0, 1), slice(1, 2), slice(2, 3)]])
    assert loaded.keys() == sent.keys() and all(torch.equal(loaded[n], sent[n]) for n in sent)
    # A later sync with fewer buckets leaves no stale file behind (each stage clears its own).
    sent = {name: tensor + 1 for name, tensor in sent.items()}
    loaded = sync([[slice(0, 3)], [slice(0, 3)]])
    assert loaded.keys() == sent.keys() and all(torch.equal(loaded[n], sent[n]) for n in sent)
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == [
        "stage00-00000.safetensors",
        "stage01-00000.safetensors",
    ]
    _, path, body = recorder.posts[-1]
    assert path == "/update_weights_from_disk" and body["model_path"] == str(tmp_path)
    assert_request_of(body, "UpdateWeightFromDiskReqInput", io_struct)


# --- engines, cache, spot check ---------------------------------------------------------------


def test_engines_are_resolved_from_what_sglang_reports():
    parallel = class_fields((src.sglang_root() / "srt/arg_groups/fields/parallel.py").read_text())
    server_args = {name for fields in parallel.values() for name in fields}
    assert {"tp_size", "pp_size", "dp_size", "attn_dp_size"} <= server_args
    info_source = src.function_source(src.COMMON, "build_server_info")
    assert "server_args.resolved_dict()" in info_source  # /server_info carries them
    # As 0.5.23 reports "--tp-size 4 --dp-size 2 --enable-dp-attention": attention DP inside
    # one TP group (one replica).
    sglang = {
        "tp_size": 4,
        "pp_size": 1,
        "dp_size": 1,
        "attn_dp_size": 2,
        "enable_dp_attention": True,
        "version": "0.5.23",
    }
    with StubServer({"/server_info": [(200, sglang)]}) as server:
        engine = resolve_engine(Engine(server.url), 5.0)
        assert (engine.tp_size, engine.kind, engine.dp_replicas) == (4, "sglang", 1)
        with pytest.raises(EngineRequestError, match="configured with tp_size 2"):
            resolve_engine(Engine(server.url, tp_size=2), 5.0)
    replicas_info = sglang | {"dp_size": 2, "attn_dp_size": 1, "enable_dp_attention": False}
    with StubServer({"/server_info": [(200, replicas_info)]}) as server:
        replicas = resolve_engine(Engine(server.url), 5.0)
        with pytest.raises(ValueError, match="same rank"):
            DistributedTransport([replicas], None, 1).check_engines()
    cpu = {"tp_size": 1, "dp_size": 1, "pp_size": 1, ENGINE_FIELD: CPU_ENGINE}
    with StubServer({"/server_info": [(200, cpu)]}) as server:  # the CPU engine
        engine = resolve_engine(Engine(server.url), 5.0)
        assert (engine.tp_size, engine.kind) == (1, "cpu")


@pytest.mark.parametrize(
    ("routes", "match"),
    [
        ({"/model_info": [(200, {"model_path": "m"})]}, "answers 404 on GET /server_info"),
        ({"/server_info": [(200, {"tp_size": 1})]}, "neither SGLang's answer"),
        ({"/server_info": [(200, {"tp_size": 1, ENGINE_FIELD: "other"})]}, "neither SGLang's"),
        ({"/server_info": [(200, {"version": "0.5.23", "tp_size": "4"})]}, "tp_size must be"),
        (
            {"/server_info": [(200, {"version": "0.5.23", "tp_size": 2, "dp_size": 0})]},
            "dp_size must be a positive int",
        ),
        ({"/server_info": [(200, ["tp_size", 1])]}, "expected a JSON object"),
    ],
)
def test_a_server_that_does_not_say_what_it_is_is_refused_not_guessed(routes, match):
    """A router (or any other server) answering 404 on /server_info but 200 elsewhere used to
    be taken for the CPU engine at TP 1; now it, and any unreadable answer, is refused."""
    with StubServer(routes) as server, pytest.raises(UnknownServer, match=match) as info:
        resolve_engine(Engine(server.url), 5.0)
    assert server.url in str(info.value) and server.calls == ["/server_info"]


def test_flush_cache_retries_while_sglang_refuses_and_gives_up_at_the_deadline():
    handler = src.function_source("srt/entrypoints/http_server.py", "flush_cache")
    assert "HTTPStatus.BAD_REQUEST" in handler  # SGLang's answer while requests are pending
    busy = (400, "Cache not flushed")
    with StubServer({"/flush_cache": [busy, busy, (200, "Cache flushed.")]}) as server:
        flush_cache(server.url, timeout_s=10, retry_s=0.01)
        assert server.calls == ["/flush_cache"] * 3
    with (
        StubServer({"/flush_cache": [busy]}) as server,
        pytest.raises(EngineRequestError, match=r"cache not flushed within 0\.2 s"),
    ):
        flush_cache(server.url, timeout_s=0.2, retry_s=0.01)


def test_spot_check_is_refused_for_sglang_serving_the_projects_model_families():
    models = src.sglang_root() / "srt/models"
    for family in protocol.WEIGHT_READBACK_FAMILIES:
        assert "def get_weights_by_name" in (models / f"{family}.py").read_text(), family
    for family in SUPPORTED_MODEL_TYPES:
        assert "def get_weights_by_name" not in (models / f"{family}.py").read_text(), family
    spec = load_hf_config("qwen3-30b-a3b")
    checked = sync_module.WeightSync(WeightSyncConfig(spot_check=2), [Engine("u")], spec)
    checked._check_spot_check([Engine("http://cpu", 1, "cpu")])  # the CPU engine: allowed
    with pytest.raises(ValueError, match="SGLang does not read back the weights of qwen3_moe"):
        checked._check_spot_check([Engine("http://gpu", 4, "sglang")])


def test_in_place_pause_cannot_flush_the_cache():
    with pytest.raises(ValueError, match="refuses to flush its prefix cache while requests run"):
        WeightSyncConfig(pause_mode="in_place")
    assert WeightSyncConfig(pause_mode="in_place", flush_cache=False).pause_mode == "in_place"
    assert protocol.update_weights_from_disk_request("d", flush_cache=False)["flush_cache"] is False


def test_sglang_source_reads_functions_without_importing_sglang():
    tree = ast.parse(src.function_source(src.COMMON, "init_custom_process_group"))
    assert tree.body[0].name == "init_custom_process_group"
    with pytest.raises(src.SglangSourceMissing, match="no function nope"):
        src.function_source(src.COMMON, "nope")
    assert callable(src.init_custom_process_group())
