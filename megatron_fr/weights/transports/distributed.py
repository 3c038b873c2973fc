"""Broadcast transport: NCCL between GPUs, gloo on CPU, one process group per engine and stage."""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from urllib.parse import urlparse

import torch

from megatron_fr.engine.backends import backend_for
from megatron_fr.engine.group import (
    CollectiveFailed,
    WeightUpdateGroup,
    create_group_store,
    host_weight_update_group,
)
from megatron_fr.engine.http import EngineRequestError, post_json
from megatron_fr.utils.net import address_towards
from megatron_fr.weights.reshard import Bucket
from megatron_fr.weights.transports.base import Engine, WeightTransport

CLOSE_TIMEOUT_S = 10.0
log = logging.getLogger("megatron_fr.weights")


def group_size(engine: Engine) -> int:
    """World size of an engine's weight-update group: the sender (rank 0) and the engine's TP
    ranks, which SGLang places at rank_offset + tp_rank (WeightUpdater.init_weights_update_
    group) with rank_offset 1."""
    return 1 + engine.known_tp_size()


def flatten_bucket(bucket: Bucket) -> torch.Tensor | None:
    """The bucket as one uint8 tensor in the layout of SGLang's FlattenedTensorBucket (each
    tensor's bytes, in order), or None where a tensor would start at a byte offset its dtype
    cannot be viewed at (SGLang's receiver refuses those; the bucket then goes tensor by
    tensor)."""
    offset = 0
    for _, tensor in bucket:
        if offset % tensor.element_size():
            return None
        offset += tensor.numel() * tensor.element_size()
    return torch.cat([tensor.contiguous().view(-1).view(torch.uint8) for _, tensor in bucket])


def dtype_name(tensor: torch.Tensor) -> str:
    """The name SGLang resolves with getattr(torch, name)."""
    return str(tensor.dtype).removeprefix("torch.")


class DistributedTransport(WeightTransport):
    """Broadcast from the stage's sending rank (rank 0 of each group) to the engines: NCCL on
    GPUs, gloo on CPU. One group per engine and pipeline stage, so that an engine that dies
    inside a broadcast holds only its own group's collective: every other engine has received
    that bucket already or has not been asked for it, answers the regroup, and stays in the
    pool (docs/weight-sync.md, "One group or a group per engine", has the timelines and the
    cost: the sender sends each bucket once per engine). A stage's groups are hosted by its
    sending rank on one TCP store at ``master_port + stage``, told apart by their names. For
    each bucket the engines are served one after the other: an engine is told what is coming
    (/update_weights_from_distributed) only when its turn comes, and receives it while that
    request is in flight: tensor by tensor, or with ``flatten`` as one buffer (load_format
    "flattened_bucket")."""

    def __init__(
        self,
        engines: list[Engine],
        master_address: str | None,
        master_port: int,
        backend: str = "gloo",
        timeout_s: float = 120.0,
        group_name: str = "weight_update_group",
        flatten: bool = False,
    ):
        super().__init__(engines, timeout_s)
        self.flatten = flatten
        self.master_address, self.master_port, self.backend = master_address, master_port, backend
        self.base_group_name = group_name
        self.groups: list[WeightUpdateGroup] = []
        """The stage's groups, in engine order, once connected."""
        self._pool = ThreadPoolExecutor(max_workers=max(2, len(engines)))

    def check_engines(self) -> None:
        for engine in self.engines:
            if engine.pp_size > 1 or engine.dp_replicas > 1:
                name = backend_for(engine.kind).name
                raise ValueError(
                    f"{engine.url}: {name} with pp_size {engine.pp_size} and "
                    f"{engine.dp_replicas} data-parallel replica(s): their ranks would join "
                    "the weight-update group at the same rank (rank_offset + tp_rank); "
                    "serve with pp_size 1 and dp_size 1 (SGLang: or --enable-dp-attention)"
                )

    def sender_address(self, stage: int) -> str:
        """Stage 0's sender is global rank 0, at the configured address if one is given;
        every other stage's sender may be on another node, and says where it is itself."""
        if stage == 0 and self.master_address:
            return self.master_address
        return address_towards(urlparse(self.engines[0].url).hostname or "127.0.0.1")

    def stage_group_names(self, stage: int) -> list[str]:
        """The names of a stage's groups, one per engine, in engine order."""
        return [f"{self.base_group_name}_pp{stage}_e{index}" for index in range(len(self.engines))]

    def group_names(self, stages: int) -> list[str]:
        return [name for stage in range(stages) for name in self.stage_group_names(stage)]

    def begin(self) -> None:
        self.on_every_engine(lambda url: self.wire.begin_update(url, self.timeout_s))

    def commit(self, version: str) -> None:
        self.on_every_engine(lambda url: self.wire.commit_update(url, version, self.timeout_s))

    def end(self) -> None:
        self.on_every_engine(lambda url: self.wire.end_update(url, self.timeout_s))

    def join_requests(self, address: str, port: int, names: list[str]) -> tuple[str, list[dict]]:
        """The calls that make each engine join its own group (`names`, in engine order) as
        ranks 1 and up: path, bodies."""
        bodies = [
            self.wire.join_group_request(
                address, port, 1, group_size(engine), name, self.backend, self.timeout_s
            )
            for engine, name in zip(self.engines, names, strict=True)
        ]
        return self.wire.join_group_path, bodies

    def update_request(
        self, bucket: Bucket, flat: torch.Tensor | None, group_name: str
    ) -> tuple[str, dict]:
        """The call that tells an engine what the next broadcasts on its group hold: path,
        body."""
        body = self.wire.receive_request(
            [name for name, _ in bucket],
            [dtype_name(tensor) for _, tensor in bucket],
            [list(tensor.shape) for _, tensor in bucket],
            group_name,
            flattened=flat is not None,
        )
        return self.wire.receive_path, body

    def connect(self, stage: int) -> None:
        """The stage's groups formed one after the other, each engine's join call in flight
        meanwhile (a join returns once the sender's end is built)."""
        names = self.stage_group_names(stage)
        address, port = self.sender_address(stage), self.master_port + stage
        joins = self._submit(*self.join_requests(address, port, names))
        store = create_group_store(address, port, self.timeout_s)
        for engine, name, join in zip(self.engines, names, joins, strict=True):
            try:
                group = host_weight_update_group(
                    store, group_size(engine), name, self.backend, self.timeout_s
                )
            except (RuntimeError, TimeoutError) as error:
                self.leave()
                if join.done():
                    join.result(timeout=0)  # the engine's own refusal says more
                raise EngineRequestError(
                    f"engine {engine.url} did not join weight group {name} at "
                    f"{address}:{port} within {self.timeout_s:g} s: {error}"
                ) from error
            self.groups.append(group)
        _raise_first_engine_error(joins, self.timeout_s)

    def send(self, bucket: Bucket) -> None:
        if len(self.groups) != len(self.engines):
            raise RuntimeError("DistributedTransport.send before connect")
        flat = flatten_bucket(bucket) if self.flatten else None
        tensors = [flat] if flat is not None else [t.contiguous() for _, t in bucket]
        for url, group in zip(self.urls, self.groups, strict=True):
            path, body = self.update_request(bucket, flat, group.name)
            call = self._pool.submit(post_json, url, path, body, self.timeout_s)
            try:
                for tensor in tensors:
                    group.broadcast(tensor)
            except CollectiveFailed as error:  # its group is aborted; say what the engine said
                raise CollectiveFailed(f"{error}{_engine_errors([url], [call])}") from None
            call.result(timeout=self.timeout_s)

    def _submit(
        self, path: str, bodies: list[dict], timeout_s: float | None = None
    ) -> list[Future]:
        """One call per engine (bodies in engine order), each on a thread of its own."""
        return [
            self._pool.submit(post_json, url, path, body, timeout_s or self.timeout_s)
            for url, body in zip(self.urls, bodies, strict=True)
        ]

    def leave(self) -> None:
        """Abort this end of every group: an engine may have died in a collective, and a
        graceful destroy would wait for it (engine/group.py)."""
        for group in self.groups:
            group.abort()
        self.groups = []

    def close(self) -> None:
        """Each engine is asked to leave its group, for CLOSE_TIMEOUT_S at most: one that does
        not answer (it died or hung since the last sync) is logged, not raised over, since the
        next connect destroys the group on it anyway (sync.py's GROUPS_FILE)."""
        if self.groups:
            bodies = [self.wire.leave_group_request(group.name) for group in self.groups]
            calls = self._submit(self.wire.leave_group_path, bodies, CLOSE_TIMEOUT_S)
            for group in self.groups:
                group.destroy()
            for url, group, call in zip(self.urls, self.groups, calls, strict=True):
                try:
                    call.result(timeout=CLOSE_TIMEOUT_S)
                except (EngineRequestError, TimeoutError) as error:
                    log.warning("%s did not leave weight group %s: %s", url, group.name, error)
            self.groups = []
        self._pool.shutdown(wait=False)


def _engine_errors(urls: list[str], calls: list[Future]) -> str:
    """What the engines' update calls that already ended in an error said (a dead engine's
    refused connection names it), for the message of a failed collective."""
    said = [
        f"{url}: {call.exception()}"
        for url, call in zip(urls, calls, strict=True)
        if call.done() and call.exception() is not None
    ]
    return f" (engines: {'; '.join(said)})" if said else ""


def _raise_first_engine_error(calls: list[Future], timeout_s: float) -> None:
    for call in calls:
        call.result(timeout=timeout_s)
