"""Broadcast transport: NCCL between GPUs, gloo on CPU, one process group per stage."""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from urllib.parse import urlparse

import torch

from megatron_fr.engine.backends import backend_for
from megatron_fr.engine.group import CollectiveFailed, WeightUpdateGroup, create_weight_update_group
from megatron_fr.engine.http import EngineRequestError, post_json
from megatron_fr.utils.net import address_towards
from megatron_fr.weights.reshard import Bucket
from megatron_fr.weights.transports.base import Engine, WeightTransport

CLOSE_TIMEOUT_S = 10.0
log = logging.getLogger("megatron_fr.weights")


def group_layout(engines: list[Engine]) -> tuple[int, list[int]]:
    """(world size, rank offset of each engine) of a weight-update group: the sender is rank
    0, and SGLang's TP rank t of an engine joins at that engine's offset + t
    (WeightUpdater.init_weights_update_group), so offsets are cumulative TP sizes."""
    offsets, next_rank = [], 1
    for engine in engines:
        offsets.append(next_rank)
        next_rank += engine.known_tp_size()
    return next_rank, offsets


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
    """Broadcast from the stage's sending rank (group rank 0) to every engine rank: NCCL on
    GPUs, gloo on CPU. One group per pipeline stage, hosted by that stage's sending rank on
    port ``master_port + stage``. For each bucket the engines are told what is coming
    (/update_weights_from_distributed) and receive it while that request is in flight: tensor
    by tensor, or with ``flatten`` as one buffer (load_format "flattened_bucket")."""

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
        self.group: WeightUpdateGroup | None = None
        self.group_name = group_name
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

    def group_names(self, stages: int) -> list[str]:
        return [f"{self.base_group_name}_pp{stage}" for stage in range(stages)]

    def begin(self) -> None:
        self.on_every_engine(lambda url: self.wire.begin_update(url, self.timeout_s))

    def commit(self, version: str) -> None:
        self.on_every_engine(lambda url: self.wire.commit_update(url, version, self.timeout_s))

    def end(self) -> None:
        self.on_every_engine(lambda url: self.wire.end_update(url, self.timeout_s))

    def join_requests(
        self, address: str, port: int, world_size: int, offsets: list[int]
    ) -> tuple[str, list[dict]]:
        """The call that makes each engine join the group at its rank offset: path, bodies."""
        bodies = [
            self.wire.join_group_request(
                address, port, offset, world_size, self.group_name, self.backend, self.timeout_s
            )
            for offset in offsets
        ]
        return self.wire.join_group_path, bodies

    def update_request(self, bucket: Bucket, flat: torch.Tensor | None) -> tuple[str, dict]:
        """The call that tells every engine what the next broadcasts hold: path, body."""
        body = self.wire.receive_request(
            [name for name, _ in bucket],
            [dtype_name(tensor) for _, tensor in bucket],
            [list(tensor.shape) for _, tensor in bucket],
            self.group_name,
            flattened=flat is not None,
        )
        return self.wire.receive_path, body

    def leave_request(self) -> tuple[str, dict]:
        """The call that makes every engine leave the group: path, body."""
        return self.wire.leave_group_path, self.wire.leave_group_request(self.group_name)

    def connect(self, stage: int) -> None:
        self.group_name = self.group_names(stage + 1)[stage]
        address, port = self.sender_address(stage), self.master_port + stage
        world_size, offsets = group_layout(self.engines)
        joins = self._submit(*self.join_requests(address, port, world_size, offsets))
        try:
            self.group = create_weight_update_group(
                address, port, world_size, self.group_name, self.backend, self.timeout_s
            )
        except (RuntimeError, TimeoutError) as error:
            _raise_first_engine_error(joins, self.timeout_s)
            raise EngineRequestError(
                f"engines {self.urls} did not join weight group {self.group_name} at "
                f"{address}:{port} within {self.timeout_s:g} s: {error}"
            ) from error
        _raise_first_engine_error(joins, self.timeout_s)

    def send(self, bucket: Bucket) -> None:
        if self.group is None:
            raise RuntimeError("DistributedTransport.send before connect")
        flat = flatten_bucket(bucket) if self.flatten else None
        path, body = self.update_request(bucket, flat)
        calls = self._submit(path, [body] * len(self.urls))
        try:
            for tensor in [flat] if flat is not None else [t.contiguous() for _, t in bucket]:
                self.group.broadcast(tensor)
        except CollectiveFailed as error:  # the group is aborted; say which engines failed
            raise CollectiveFailed(f"{error}{_engine_errors(self.urls, calls)}") from None
        _raise_first_engine_error(calls, self.timeout_s)

    def _submit(
        self, path: str, bodies: list[dict], timeout_s: float | None = None
    ) -> list[Future]:
        """One call per engine (bodies in engine order), each on a thread of its own."""
        return [
            self._pool.submit(post_json, url, path, body, timeout_s or self.timeout_s)
            for url, body in zip(self.urls, bodies, strict=True)
        ]

    def leave(self) -> None:
        """Abort this end of the group: an engine may have died in a collective, and a
        graceful destroy would wait for it (engine/group.py)."""
        if self.group is not None:
            self.group.abort()
            self.group = None

    def close(self) -> None:
        """The engines are asked to leave the group, for CLOSE_TIMEOUT_S at most: one that
        does not answer (it died or hung since the last sync) is logged, not raised over,
        since the next connect destroys the group on it anyway (sync.py's GROUPS_FILE)."""
        if self.group is not None:
            path, body = self.leave_request()
            calls = self._submit(path, [body] * len(self.urls), CLOSE_TIMEOUT_S)
            self.group.destroy()
            self.group = None
            for url, call in zip(self.urls, calls, strict=True):
                try:
                    call.result(timeout=CLOSE_TIMEOUT_S)
                except (EngineRequestError, TimeoutError) as error:
                    log.warning("%s did not leave weight group %s: %s", url, self.group_name, error)
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
