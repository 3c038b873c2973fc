"""The sending end (rank 0) of the process group between a learner rank and the engines' ranks.

SGLang's ranks join with ``init_custom_process_group`` (srt/utils/common.py): a ``tcp://``
rendezvous (a TCPStore client), ``PrefixStore(group_name, store)``, then torch's
``_new_process_group_helper``, which prefixes the keys again with the group name and the
device before the backend rendezvous. Rank 0 must build the same stack, or the two sides wait
on different keys. This module builds it with one difference: the TCPStore server is created
directly, not through ``rendezvous("tcp://...")``, because under torchrun that handler makes
rank 0 a client of the job's agent store (TORCHELASTIC_USE_AGENT_STORE), where nobody would
host the group's port. tests/distributed/test_weight_group.py checks this sender against
SGLang's own function, read from the installed package, in separate processes.

A peer may die in the middle of a broadcast (an engine killed or its GPU lost). The group is
built so that this fails the collective, never the learner: NCCL's watchdog is told, for this
group alone, to abort the communicator on an error or a timeout and leave the process alone
(TORCH_NCCL_ASYNC_ERROR_HANDLING=2, CleanUpOnly; torch reads it when the group is constructed,
and its default, 3, tears the whole process down), every wait is bounded by the group's
timeout on the CPU, and a group whose collective failed is aborted (torch's
`_abort_process_group`), never destroyed gracefully: a graceful destroy waits for the stalled
collective it is meant to end.

torch's NCCL monitoring is process-wide (docs/weight-sync.md, "A dead engine inside a sync",
has the source lines): a watchdog that sees a collective fail or time out calls
broadcastDumpSignal, which sets the static ProcessGroupNCCL::shouldDump_; the default group's
heartbeat monitor (uid 0, checking it when that group was built with
TORCH_NCCL_DUMP_ON_TIMEOUT on, torch's default) then dumps, sleeps
TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC (480 s) and terminates the process; each group's own monitor
terminates it too when its watchdog stops beating for that long. So:
  * the weight group's watchdog never times a collective out itself: its NCCL timeout is the
    wait's bound plus WATCHDOG_MARGIN_S, and the wait (weights.timeout_s) aborts the group
    first (an aborted communicator's work completes, and the watchdog drops it);
  * its own heartbeat monitor neither terminates nor arms the dump (NCCL_GROUP_ENV:
    TORCH_NCCL_ENABLE_MONITORING=0, a heartbeat timeout no sync reaches), and a failure its
    watchdog does see (a peer's socket closing) sleeps 4 x 1 s before the CleanUpOnly abort,
    not 4 x 15 s (TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC);
  * the learner's process starts with TORCH_NCCL_DUMP_ON_TIMEOUT=0 unless set
    (PROCESS_NCCL_ENV, match_sglang_nccl_env), so the default group's monitor does not act
    on the shared flag: megatron's own groups still tear the process down on their own
    timeouts (TORCH_NCCL_ASYNC_ERROR_HANDLING 3, parallel.timeout_minutes), without the
    flight-recorder dump (empty unless TORCH_NCCL_TRACE_BUFFER_SIZE is set).
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import (
    Backend,
    GroupName,
    _abort_process_group,
    _new_process_group_helper,
    _world,
)

BACKENDS = ("gloo", "nccl")
NCCL_CUMEM = "NCCL_CUMEM_ENABLE"
SGLANG_NCCL_CUMEM = "0"
"""What SGLang sets NCCL_CUMEM_ENABLE to for itself when it is unset (srt/entrypoints/engine.py:
_set_envs_and_config, without --enable-symm-mem or the KV-shard gather)."""
NCCL_GROUP_ENV = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
    "TORCH_NCCL_ENABLE_MONITORING": "0",
    "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": str(7 * 24 * 3600),
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
    "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "1000",
}
"""The environment a weight-update NCCL group is constructed under (module docstring): on an
error or a timeout its watchdog aborts the communicator (CleanUpOnly) instead of tearing the
learner down; its heartbeat monitor terminates nothing and arms no dump; a failure its
watchdog sees waits 4 s, not 60, before that abort. Read once, at construction (the
ProcessGroupNCCL, its Watchdog and its HeartbeatMonitor constructors); the learner's own
groups keep what the process has."""
PROCESS_NCCL_ENV = {"TORCH_NCCL_DUMP_ON_TIMEOUT": "0"}
"""Defaults of the learner's process (a value the user set is kept): the default group's
monitor ignores the process-wide dump flag a weight group's failure sets (module docstring)."""
WATCHDOG_MARGIN_S = 60.0
"""The weight group's NCCL timeout is the wait's bound plus this: the waiting thread aborts
the group before its watchdog could time the collective out (and arm the dump)."""


class CollectiveFailed(RuntimeError):
    """A collective of the weight-update group failed or did not finish in time (a peer died
    or hung); the group has been aborted and cannot be used again."""


@dataclass
class WeightUpdateGroup:
    """The group and the TCP store it was built on (the store's server must outlive it)."""

    group: dist.ProcessGroup
    store: dist.Store
    rank: int
    world_size: int
    name: str
    timeout: datetime.timedelta = datetime.timedelta(seconds=300)
    """The longest any collective of the group may take before it counts as failed."""
    usable: bool = field(default=True, init=False)
    """False once a collective failed or the group was released."""

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Send one tensor from rank 0 (this end) to every engine rank, in place; the wait is
        bounded by the group's timeout on the CPU (an NCCL work would otherwise only order
        the streams and leave the stall to the next synchronisation). CollectiveFailed, with
        the group aborted, if it did not complete."""
        if not self.usable:
            raise CollectiveFailed(f"weight group {self.name} was aborted or released")
        try:
            work = self.group.broadcast([tensor], dist.BroadcastOptions())
            completed = work.wait(self.timeout)
        except RuntimeError as error:  # gloo and NCCL raise their errors through wait()
            self.abort()
            raise CollectiveFailed(
                f"broadcast on weight group {self.name} failed: {error}"
            ) from None
        if completed is False:  # a backend that reports the timeout instead of raising it
            self.abort()
            raise CollectiveFailed(
                f"broadcast on weight group {self.name} did not finish within "
                f"{self.timeout.total_seconds():g} s"
            )

    def abort(self) -> None:
        """Release this end now, whatever the peers do: the communicator is aborted, so no
        stalled collective is waited for (idempotent)."""
        if self.usable:
            self.usable = False
            _abort_process_group(self.group)

    def destroy(self) -> None:
        """Release this end after the peers were asked to leave: gracefully while every
        collective completed, else (a collective failed) the abort that already happened."""
        if self.usable:
            self.usable = False
            dist.destroy_process_group(self.group)


def match_sglang_nccl_env(environ: MutableMapping[str, str] = os.environ) -> str:
    """Give NCCL_CUMEM_ENABLE the value SGLang gives itself when it is unset, and return it.

    Both ends of the weight-update NCCL group must run with the same setting (a communicator
    whose ranks disagree on cuMem buffers fails or hangs), and SGLang sets its own when the
    variable is unset. Called at the start of `train`, before this process or its torchrun
    children create any NCCL communicator; engines started from here inherit it, and a value
    the user set is kept (SGLang keeps it too). PROCESS_NCCL_ENV's defaults are set with it,
    at the same moment and for the same reason (before the default group is built)."""
    for name, value in PROCESS_NCCL_ENV.items():
        environ.setdefault(name, value)
    return environ.setdefault(NCCL_CUMEM, SGLANG_NCCL_CUMEM)


def create_group_store(master_address: str, master_port: int, timeout_s: float) -> dist.TCPStore:
    """The TCP store the sender hosts its weight-update groups on (the engines' ranks are its
    clients; several groups share one store, each under its own name)."""
    return dist.TCPStore(
        master_address,
        master_port,
        is_master=True,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )


def create_weight_update_group(
    master_address: str,
    master_port: int,
    world_size: int,
    group_name: str,
    backend: str = "gloo",
    timeout_s: float = 300.0,
) -> WeightUpdateGroup:
    """Host the weight-update group as its rank 0 on a store of its own at the address and
    port; blocks until all world_size ranks joined (the engines join after POST
    /init_weights_update_group with the same address, port, name and world size)."""
    store = create_group_store(master_address, master_port, timeout_s)
    return host_weight_update_group(store, world_size, group_name, backend, timeout_s)


def host_weight_update_group(
    store: dist.TCPStore,
    world_size: int,
    group_name: str,
    backend: str = "gloo",
    timeout_s: float = 300.0,
) -> WeightUpdateGroup:
    """Host the weight-update group as its rank 0 on `store` (create_group_store), which may
    host other groups (each is told apart by its name); blocks until all world_size ranks
    joined."""
    if backend not in BACKENDS:
        raise ValueError(f"weight-update backend must be one of {BACKENDS}, got {backend!r}")
    timeout = datetime.timedelta(seconds=timeout_s)
    # NCCL: the watchdog's own timeout past the wait's bound (WATCHDOG_MARGIN_S)
    margin = WATCHDOG_MARGIN_S if backend == "nccl" else 0.0
    group_timeout = datetime.timedelta(seconds=timeout_s + margin)
    prefixed = dist.PrefixStore(group_name, store)  # as init_custom_process_group after rendezvous
    with construction_environment(backend):
        group, _ = _new_process_group_helper(
            world_size,
            0,
            [],
            Backend(backend),
            prefixed,
            group_name=GroupName(group_name),
            backend_options=None,
            timeout=group_timeout,
            device_id=None,
        )
    # SGLang registers the group's ranks as identity so dist.* calls may name them directly.
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return WeightUpdateGroup(group, store, 0, world_size, group_name, timeout)


@contextlib.contextmanager
def construction_environment(
    backend: str, environ: MutableMapping[str, str] = os.environ
) -> Iterator[None]:
    """NCCL_GROUP_ENV set while an NCCL group is constructed, the previous values restored
    after (gloo groups need nothing)."""
    wanted = NCCL_GROUP_ENV if backend == "nccl" else {}
    before = {name: environ.get(name) for name in wanted}
    environ.update(wanted)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                environ.pop(name, None)
            else:
                environ[name] = value
