"""The data path's two ends: the rollout side sends each replica only its share of a batch.

    rollout service process                          learner ranks
    ShareSender (rank 0 of the data group) ───────► stage leaders: the (TP 0, CP 0) rank of
        per step: the step plan, then for each (DP      each (DP rank, PP stage), ranks 1.. of
      rank d, PP stage s) the trajectories of d's      the data group (a gloo group of its
      share with the routing of s's layers             own: the service is not a torchrun rank)
      (buffer/shards.py)
                                                   ─► broadcast within the stage's TP x CP
                                                      ranks (a gloo group of the learner world)
    every learner rank then has the step plan (learner/step_plan.py: a few numbers per
    trajectory, pickled) and its DP share's trajectories (ShareReceiver.receive): what it needs
    to build its micro-batches.

Bytes per rank are about 1/DP of the batch's tokens (plus a stage's share of the routing)
instead of the whole batch pickled to every rank; tools/bench_data_path.py measures both.

Joining: the sender hosts the data group's TCPStore; each stage leader connects, then tells
the sender its (DP rank, PP stage, first layer, end layer) in a handshake, so the sender needs
no knowledge of the learner's layout beyond the group size.
"""

from __future__ import annotations

import datetime
import os
import pickle
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist

from megatron_fr.buffer.shards import (
    PointToPoint,
    TrajectoryShard,
    broadcast_shard,
    pack_shard,
    recv_shard,
    send_shard,
)
from megatron_fr.buffer.trajectory import Trajectory
from megatron_fr.learner.step_plan import StepPlan
from megatron_fr.utils.net import address_towards

if TYPE_CHECKING:  # megatron stays out of the rollout process, which sends from this module
    from megatron.core.process_groups_config import ProcessGroupCollection

GLOO_SOCKET_IFNAME = "GLOO_SOCKET_IFNAME"
HANDSHAKE = 4
"""(DP rank, PP stage, first layer, end layer) of a stage leader; layers -1 without routing."""


@dataclass(frozen=True)
class DataPathAddress:
    """Where the sender's store listens, and how many stage leaders join."""

    host: str
    port: int
    leaders: int
    timeout_s: float = 600.0


def _data_group(address: DataPathAddress, rank: int) -> PointToPoint:
    """The sender (rank 0) hosts the store at address.host; every member binds its gloo end
    to gloo_device(address.host), never to what its host name resolves to."""
    timeout = datetime.timedelta(seconds=address.timeout_s)
    size = address.leaders + 1
    store = dist.TCPStore(address.host, address.port, size, rank == 0, timeout=timeout)
    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # not in stubs
    options._timeout = timeout
    options._devices = [gloo_device(address.host)]
    # torch's stubs omit the gloo backend's send/recv, which it has
    return cast(PointToPoint, dist.ProcessGroupGloo(store, rank, size, options))


def gloo_device(toward: str, environ: Mapping[str, str] = os.environ) -> object:
    """This process's end of a gloo group whose store is at `toward`: on the interface
    GLOO_SOCKET_IFNAME names when it is set (the user's choice, as for torch's own groups),
    else on this machine's address that routes to `toward` (the sender's own address, on the
    node that hosts it)."""
    interface = environ.get(GLOO_SOCKET_IFNAME, "").split(",")[0]
    if interface:
        return dist.ProcessGroupGloo.create_device(interface=interface)
    return dist.ProcessGroupGloo.create_device(hostname=address_towards(toward))


class ShareSender:
    """The rollout side: sends each stage leader its DP share of every batch."""

    def __init__(self, address: DataPathAddress) -> None:
        self.group = _data_group(address, 0)
        self.leaders: dict[int, tuple[int, int, slice | None]] = {}
        """data-group rank -> (DP rank, PP stage, the stage's layers or None)."""
        for rank in range(1, address.leaders + 1):
            hello = torch.empty(HANDSHAKE, dtype=torch.int64)
            self.group.recv([hello], rank, 0).wait()
            dp, stage, first, end = hello.tolist()
            self.leaders[rank] = (dp, stage, slice(first, end) if first >= 0 else None)

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks of the learner (the step plans' DP size)."""
        return 1 + max(dp for dp, _, _ in self.leaders.values())

    def send(self, batch: Sequence[Trajectory], step: StepPlan) -> tuple[list, dict[int, int]]:
        """Start sending every leader the plan and its share; (the works to wait on, bytes
        per leader)."""
        plan = _as_tensor(pickle.dumps(step))
        works, sent = [], {}
        for rank, (dp, _, layers) in self.leaders.items():
            shard = pack_shard(batch, step.share(dp), layers)
            works += _send_bytes(self.group, plan, rank) + send_shard(self.group, shard, rank)
            sent[rank] = plan.numel() + 8 + shard.nbytes
        return works, sent


class ShareReceiver:
    """A learner rank's end: its DP share of each batch, through its stage leader.

    groups: megatron's ProcessGroupCollection of this rank (dp, pp, tp, cp). Every rank of
    the learner world constructs one (the stage groups are made collectively)."""

    def __init__(
        self, groups: ProcessGroupCollection, address: DataPathAddress, stage_layers: slice | None
    ) -> None:
        stage = (groups.dp.rank(), groups.pp.rank())
        everyone: list[tuple[int, int]] = [(0, 0)] * dist.get_world_size()
        dist.all_gather_object(everyone, stage)
        stages = sorted(set(everyone))
        for each in stages:  # every rank takes part in making every group, in one order
            members = [rank for rank, of in enumerate(everyone) if of == each]
            group = dist.new_group(members, backend="gloo")
            if each == stage:
                self.stage_group, self.leader = group, members[0]
        self.data_group: PointToPoint | None = None
        if dist.get_rank() == self.leader:
            self.data_group = _data_group(address, 1 + stages.index(stage))
            first, end = (
                (-1, -1) if stage_layers is None else (stage_layers.start, stage_layers.stop)
            )
            hello = torch.tensor([*stage, first, end], dtype=torch.int64)
            self.data_group.send([hello], 0, 0).wait()

    def receive(self) -> tuple[StepPlan, TrajectoryShard]:
        """This step's plan and share: from the sender on the stage leader, then broadcast
        within the stage's TP x CP ranks."""
        plan: torch.Tensor | None = None
        shard: TrajectoryShard | None = None
        if self.data_group is not None:
            plan, shard = _recv_bytes(self.data_group, 0), recv_shard(self.data_group, 0)
        plan = _broadcast_bytes(self.stage_group, plan, self.leader)
        shard = broadcast_shard(self.stage_group, shard, self.leader)
        return pickle.loads(plan.numpy().tobytes()), shard


def _as_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _send_bytes(group: PointToPoint, payload: torch.Tensor, dst: int) -> list:
    size = torch.tensor([payload.numel()], dtype=torch.int64)
    return [group.send([size], dst, 0), group.send([payload], dst, 0)]


def _recv_bytes(group: PointToPoint, src: int) -> torch.Tensor:
    size = torch.empty(1, dtype=torch.int64)
    group.recv([size], src, 0).wait()
    payload = torch.empty(int(size), dtype=torch.uint8)
    group.recv([payload], src, 0).wait()
    return payload


def _broadcast_bytes(
    group: dist.ProcessGroup, payload: torch.Tensor | None, src: int
) -> torch.Tensor:
    size = torch.tensor([-1 if payload is None else payload.numel()], dtype=torch.int64)
    dist.broadcast(size, src=src, group=group)
    if payload is None:
        payload = torch.empty(int(size), dtype=torch.uint8)
    dist.broadcast(payload, src=src, group=group)
    return payload
