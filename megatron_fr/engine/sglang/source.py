"""SGLang's own code for the weight-update group, taken from the installed sglang package.

The CPU engine joins the learner's weight-update group and receives the broadcast tensors the
way SGLang does, by running SGLang's functions: ``init_custom_process_group``
(srt/utils/common.py), ``WeightUpdater.receive_weights_from_distributed`` and its flattened
bucket path (srt/model_executor/model_runner_components/weight_updater.py), and
``FlattenedTensorBucket`` (srt/weight_sync/tensor_bucket.py). So the learner's sender is tested
against the receiver a cluster runs, not against a copy of ours. The colocated tensor
transport serializes as SGLang does, with SGLang's ``MultiprocessingSerializer.serialize``
after SGLang's ``monkey_patch_torch_reductions`` (srt/utils/patch_torch.py), the patch SGLang's
receiver applies before it opens a payload (BaseTpWorker.deserialize_own_rank).

Importing those modules fails on a CPU machine (``sglang.srt.utils`` pulls orjson, triton and
the rest of SGLang's GPU set, and sglang is installed there without its dependencies), but the
functions themselves need only torch. Where the import works (a GPU install) it is used;
elsewhere each function is read from its file with ``ast`` and executed on its own, in a
namespace holding exactly the names it uses. Nothing here runs at import time.
"""

from __future__ import annotations
import __future__

import ast
import contextlib
import functools
import importlib
import importlib.util
import threading
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from pathlib import Path
from types import SimpleNamespace
from typing import Any

COMMON = "srt/utils/common.py"
WEIGHT_UPDATER = "srt/model_executor/model_runner_components/weight_updater.py"
TENSOR_BUCKET = "srt/weight_sync/tensor_bucket.py"
PATCH_TORCH = "srt/utils/patch_torch.py"
SGLANG_VERSION = "0.5.23"
"""The version whose code the project's weight transports were checked against."""


class SglangSourceMissing(RuntimeError):
    """The sglang package (or the function asked for) is not installed here."""


def sglang_root() -> Path:
    """The installed sglang package directory, found without importing (executing) it."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise SglangSourceMissing(
            f"the sglang package is not installed; on CPU: pip install --no-deps "
            f"sglang=={SGLANG_VERSION} (tools/setup_cpu.sh does)"
        )
    return Path(next(iter(spec.submodule_search_locations)))


_AST_LOCK = threading.RLock()
"""CPython 3.11's ast module is not safe to run on two threads at once (its recursion guard
fails with SystemError); the engine's first joins may read SGLang's code concurrently."""


def function_source(relative_path: str, name: str, class_name: str | None = None) -> str:
    """The source of top-level function `name` (or method `name` of `class_name`)."""
    with _AST_LOCK:
        return _function_source(relative_path, name, class_name)


def _function_source(relative_path: str, name: str, class_name: str | None) -> str:
    path = sglang_root() / relative_path
    tree = ast.parse(path.read_text())
    body = tree.body
    if class_name is not None:
        classes = [n for n in body if isinstance(n, ast.ClassDef) and n.name == class_name]
        if not classes:
            raise SglangSourceMissing(f"{path}: no class {class_name}")
        body = classes[0].body
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == name:
            return ast.unparse(node)
    where = f"{class_name}.{name}" if class_name else name
    raise SglangSourceMissing(f"{path}: no function {where} (is sglang {SGLANG_VERSION}?)")


def exec_function(source: str, name: str, namespace: dict[str, Any]) -> Callable:
    """Define the one function in `source` inside `namespace` and return it. Annotations stay
    unevaluated (as under ``from __future__ import annotations``): they name SGLang types
    that are not in the namespace."""
    flags = __future__.annotations.compiler_flag
    with _AST_LOCK:
        code = compile(source, f"<sglang {name}>", "exec", flags=flags, dont_inherit=True)
    exec(code, namespace)
    return namespace[name]


def _import_or_none(module: str, attribute: str) -> Any:
    try:
        return getattr(importlib.import_module(module), attribute)
    except Exception:  # any failure of SGLang's import chain means: read the file instead
        return None


@functools.cache
def init_custom_process_group() -> Callable:
    """SGLang's ``init_custom_process_group``: rendezvous (tcp://), PrefixStore(group_name),
    then torch's ``_new_process_group_helper``, which adds its own prefixes on top."""
    imported = _import_or_none("sglang.srt.utils", "init_custom_process_group")
    if imported is not None:
        return imported
    import packaging.version
    import torch

    release = packaging.version.parse(torch.__version__).release
    namespace = {"torch": torch, "torch_release": release}
    source = function_source(COMMON, "init_custom_process_group")
    return exec_function(source, "init_custom_process_group", namespace)


@functools.cache
def flattened_tensor_bucket() -> type:
    """SGLang's ``FlattenedTensorBucket`` (its module imports only torch and dataclasses)."""
    imported = _import_or_none("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorBucket")
    if imported is not None:
        return imported
    path = sglang_root() / TENSOR_BUCKET
    spec = importlib.util.spec_from_file_location("_sglang_tensor_bucket", path)
    if spec is None or spec.loader is None:
        raise SglangSourceMissing(f"{path}: not a Python file (is sglang {SGLANG_VERSION}?)")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.FlattenedTensorBucket


@functools.cache
def _receive_methods() -> tuple[Callable, Callable]:
    import torch

    namespace = {"torch": torch, "FlattenedTensorBucket": flattened_tensor_bucket()}

    def method(name: str) -> Callable:
        return exec_function(
            function_source(WEIGHT_UPDATER, name, "WeightUpdater"), name, namespace
        )

    receive = method("receive_weights_from_distributed")
    return receive, method("_receive_bucketed_weights_from_distributed")


def module_constant(relative_path: str, name: str) -> Any:
    """The literal value a top-level assignment `name = ...` gives in an SGLang file."""
    path = sglang_root() / relative_path
    with _AST_LOCK:
        tree = ast.parse(path.read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(target, ast.Name) and target.id == name for target in node.targets
        ):
            return ast.literal_eval(node.value)
    raise SglangSourceMissing(f"{path}: no constant {name} (is sglang {SGLANG_VERSION}?)")


@functools.cache
def monkey_patch_torch_reductions() -> Callable[[], None]:
    """SGLang's ``monkey_patch_torch_reductions`` (CUDA builds): afterwards torch's CUDA tensor
    reduction records the device's UUID instead of its index, and the rebuild maps a UUID back
    to the local index (an index passes unchanged), so a CUDA IPC handle opens on the right GPU
    however each process numbers them. Its module imports SGLang's GPU set, so where that
    import fails the functions are read from the file."""
    imported = _import_or_none("sglang.srt.utils.patch_torch", "monkey_patch_torch_reductions")
    if imported is not None:
        return imported
    from typing import Union

    import torch
    from torch.multiprocessing import reductions

    namespace: dict[str, Any] = {
        "torch": torch,
        "reductions": reductions,
        "_is_npu": False,
        "Callable": Callable,
        "Union": Union,
    }
    namespace["_REDUCE_TENSOR_ARG_DEVICE_INDEX"] = module_constant(
        PATCH_TORCH, "_REDUCE_TENSOR_ARG_DEVICE_INDEX"
    )
    for name in (
        "_modify_tuple",
        "_device_to_uuid",
        "_device_from_maybe_uuid",
        "_reduce_tensor_modified",
        "_rebuild_cuda_tensor_modified",
        "monkey_patch_torch_reductions",
    ):
        exec_function(function_source(PATCH_TORCH, name), name, namespace)
    return namespace["monkey_patch_torch_reductions"]


@functools.cache
def serialize() -> Callable[..., Any]:
    """SGLang's ``MultiprocessingSerializer.serialize`` (ForkingPickler, optionally base64)."""
    imported = _import_or_none("sglang.srt.utils", "MultiprocessingSerializer")
    if imported is not None:
        return imported.serialize
    import base64
    import io
    from multiprocessing.reduction import ForkingPickler

    namespace = {"io": io, "ForkingPickler": ForkingPickler, "pybase64": base64}
    source = function_source(COMMON, "serialize", "MultiprocessingSerializer")
    return exec_function(source, "serialize", namespace)


JoinArgs = tuple[str, int, int, int, str, str]
"""DistributedReceiver.join's arguments before timeout_s: master_address, master_port,
rank_offset, world_size, group_name, backend."""

MAX_PENDING_JOINS = 8
"""Joins that may wait for their masters at once (each holds a thread: start_join)."""


class DistributedReceiver:
    """The receiving half of SGLang's WeightUpdater for one process holding one TP rank:
    the groups it joined by name, and SGLang's own receive code run on them."""

    def __init__(self, tp_rank: int = 0, device: str = "cpu"):
        self.tp_rank, self.device = tp_rank, device
        self.groups: dict[str, Any] = {}
        self._pending = 0
        self._lock = threading.Lock()

    def start_join(self, args: JoinArgs, timeout_s: float) -> Future:
        """join(*args, timeout_s) on a thread of its own; its future gives the rank. torch's
        store client waits forever on a master that accepts the connection and never answers,
        whatever its timeout, so the caller waits on the future (and cancels it) instead of on
        the thread; a join that succeeds after its future was cancelled leaves the group
        again. ValueError when MAX_PENDING_JOINS joins are still waiting."""
        with self._lock:
            if self._pending >= MAX_PENDING_JOINS:
                raise ValueError(
                    f"{self._pending} weight-group joins are still waiting for their masters; "
                    "check master_address and master_port"
                )
            self._pending += 1
        future: Future = Future()
        threading.Thread(
            target=self._join_for,
            args=(future, args, timeout_s),
            daemon=True,
            name="weight-group-join",
        ).start()
        return future

    def _join_for(self, future: Future, args: JoinArgs, timeout_s: float) -> None:
        try:
            rank = self.join(*args, timeout_s=timeout_s)
        except BaseException as error:  # handed to the caller, whatever it is
            with contextlib.suppress(InvalidStateError):
                future.set_exception(error)
            return
        finally:
            with self._lock:
                self._pending -= 1
        try:
            future.set_result(rank)
        except InvalidStateError:  # the caller gave up: leave the group it no longer expects
            self.destroy(args[4])

    def join(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
        timeout_s: float | None = None,
    ) -> int:
        """As SGLang's WeightUpdater.init_weights_update_group: rank = offset + tp_rank.
        `timeout_s` bounds the rendezvous and the group's operations (None: torch's default,
        30 minutes, as SGLang)."""
        import datetime

        if group_name in self.groups:
            raise ValueError(f"weight update group {group_name!r} exists; destroy it first")
        rank = rank_offset + self.tp_rank
        timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
        self.groups[group_name] = init_custom_process_group()(
            backend=backend,
            init_method=f"tcp://{master_address}:{master_port}",
            world_size=world_size,
            rank=rank,
            group_name=group_name,
            timeout=timeout,
        )
        return rank

    def receive(
        self, names: list, dtypes: list, shapes: list, group_name: str, load_format: str | None
    ) -> list:
        """(name, tensor) pairs broadcast by group rank 0, as SGLang receives them."""
        receive, receive_bucketed = _receive_methods()
        state = SimpleNamespace(_model_update_group=self.groups, device=self.device)
        state._receive_bucketed_weights_from_distributed = functools.partial(
            receive_bucketed, state
        )
        return receive(
            state,
            names=names,
            dtypes=dtypes,
            shapes=shapes,
            group_name=group_name,
            load_format=load_format,
        )

    def destroy(self, group_name: str) -> bool:
        import torch.distributed as dist

        group = self.groups.pop(group_name, None)
        if group is not None:
            dist.destroy_process_group(group)
        return group is not None
