"""The learner's weight-update sender against SGLang's own receiving code, in separate
processes: SGLang's init_custom_process_group and WeightUpdater receive methods, read from
the installed sglang package (engine/sglang/source.py), on gloo.

Two servers at TP2 each join a group of their own, 1 + 2 = 3 ranks (the sender rank 0; SGLang's
TP rank t of a server joins at rank_offset + t, rank_offset 1), both groups hosted by the
sender on one TCP store and told apart by name, as the transport forms them. A hand-built sender
(TCPStore -> PrefixStore -> ProcessGroupGloo) waits on other keys than SGLang's ranks: the
negative control shows the test can tell the two apart.
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing as mp
import os

import pytest
import torch

from megatron_fr.engine.group import (
    create_group_store,
    create_weight_update_group,
    host_weight_update_group,
)
from megatron_fr.utils.net import free_port
from megatron_fr.weights.transports.base import Engine
from megatron_fr.weights.transports.distributed import flatten_bucket, group_size

GROUP = "weight_update_group_pp0"


def bucket() -> list[tuple[str, torch.Tensor]]:
    """Mixed dtypes and shapes, offsets aligned for the flattened layout."""
    return [
        ("model.embed_tokens.weight", torch.arange(12, dtype=torch.float32).reshape(3, 4)),
        ("model.norm.weight", torch.tensor([0.5, -1.25, 3.0, 7.5], dtype=torch.bfloat16)),
        ("lm_head.weight", torch.linspace(-1, 1, 6, dtype=torch.float32).reshape(2, 3)),
    ]


def portable(pairs: list) -> list:
    """Plain values: a tensor put on a multiprocessing queue travels as a file descriptor that
    is gone once the sending process has exited."""
    return [(name, str(t.dtype), t.float().tolist()) for name, t in pairs]


def restored(pairs: list) -> list:
    return [
        (name, torch.tensor(values, dtype=getattr(torch, dtype.removeprefix("torch."))))
        for name, dtype, values in pairs
    ]


def broadcast_bucket_to(port: int, world_size: int, name: str):
    """Host group `name` as its rank 0 and broadcast bucket() on it; the group."""
    group = create_weight_update_group("127.0.0.1", port, world_size, name, "gloo", 60)
    for _, tensor in bucket():
        group.broadcast(tensor)
    return group


def stop_all(procs: dict) -> None:
    for proc in procs.values():
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()


def assert_is_the_bucket(got: list) -> None:
    assert [name for name, _ in got] == [name for name, _ in bucket()]
    for (_, tensor), (_, sent) in zip(got, bucket(), strict=True):
        assert tensor.dtype == sent.dtype and torch.equal(tensor, sent)


def sglang_tp_rank(group: str, tp_rank: int, world: int, port: int, results) -> None:
    """One TP rank of an SGLang server in its group: joins with SGLang's function at
    rank_offset 1, receives one bucket tensor by tensor and one flattened, with SGLang's
    receive code."""
    from megatron_fr.engine.sglang.source import DistributedReceiver

    receiver = DistributedReceiver(tp_rank=tp_rank)
    try:
        rank = receiver.join("127.0.0.1", port, 1, world, group, "gloo")
        names = [name for name, _ in bucket()]
        dtypes = [str(t.dtype).removeprefix("torch.") for _, t in bucket()]
        shapes = [list(t.shape) for _, t in bucket()]
        per_tensor = receiver.receive(names, dtypes, shapes, group, None)
        flat = receiver.receive(names, dtypes, shapes, group, "flattened_bucket")
        results.put((group, rank, portable(per_tensor), portable(flat)))
        receiver.destroy(group)
    except Exception as error:  # reported, so the test fails with the cause
        results.put((group, f"tp {tp_rank}", repr(error), None))


def sglang_rank_alone(port: int, results) -> None:
    from megatron_fr.engine.sglang.source import init_custom_process_group

    try:
        init_custom_process_group()(
            backend="gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            world_size=2,
            rank=1,
            group_name=GROUP,
            timeout=datetime.timedelta(seconds=4),
        )
        results.put("joined")
    except Exception as error:
        results.put(type(error).__name__)


@pytest.mark.distributed
def test_two_servers_at_tp2_each_join_a_group_of_their_own_on_one_store(monkeypatch):
    engines = [Engine("http://a", tp_size=2, kind="sglang"), Engine("http://b", tp_size=2)]
    world = group_size(engines[0])
    assert [group_size(engine) for engine in engines] == [3, 3]
    groups = [f"{GROUP}_e{index}" for index in range(len(engines))]
    ctx = mp.get_context("spawn")
    results, port = ctx.Queue(), free_port()
    procs = [
        ctx.Process(target=sglang_tp_rank, args=(group, tp, world, port, results))
        for group in groups
        for tp in range(2)
    ]
    for proc in procs:
        proc.start()
    # The sender runs as a torchrun rank does: there, a tcp:// rendezvous would make it a
    # client of the agent's store; the sender hosts its own store and is unaffected.
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    try:
        store = create_group_store("127.0.0.1", port, 120)
        hosted = [host_weight_update_group(store, world, name, "gloo", 120) for name in groups]
        for group in hosted:  # engine after engine, as the transport sends
            for _, tensor in bucket():
                group.broadcast(tensor)
            group.broadcast(flatten_bucket(bucket()))
        received = sorted((results.get(timeout=120) for _ in procs), key=str)
        for group in hosted:
            group.destroy()
    finally:
        for proc in procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()
    assert [(group, rank) for group, rank, _, _ in received] == [
        (groups[0], 1),
        (groups[0], 2),
        (groups[1], 1),
        (groups[1], 2),
    ], received
    for _, _, per_tensor, flat in received:
        for got in (restored(per_tensor), restored(flat)):
            assert_is_the_bucket(got)


def sglang_regroup_rank(role: str, ports: tuple[int, int], regroup, results) -> None:
    """A TP1 SGLang server in the pool's regroup, with SGLang's own join, receive and group
    code: both join group A and receive a bucket; "dies" then exits without leaving A; "stays"
    waits for the regroup, leaves A (whose other member is dead), joins group B under a fresh
    name with the sender alone, and receives there."""
    from megatron_fr.engine.sglang.source import DistributedReceiver

    receiver = DistributedReceiver()
    names = [name for name, _ in bucket()]
    dtypes = [str(t.dtype).removeprefix("torch.") for _, t in bucket()]
    shapes = [list(t.shape) for _, t in bucket()]
    try:
        offset = 1 if role == "stays" else 2
        receiver.join("127.0.0.1", ports[0], offset, 3, "group_a", "gloo", timeout_s=60)
        first = receiver.receive(names, dtypes, shapes, "group_a", None)
        if role == "dies":
            results.put((role, portable(first)))
            results.close()
            results.join_thread()  # the answer is out before the process is
            os._exit(0)  # as if killed: it leaves no group
        regroup.wait(60)
        with contextlib.suppress(ValueError):  # a second group of A's name is refused
            receiver.join("127.0.0.1", ports[1], 1, 2, "group_a", "gloo", timeout_s=5)
            raise AssertionError("joined a second group under a name it holds")
        assert receiver.destroy("group_a")
        receiver.join("127.0.0.1", ports[1], 1, 2, "group_b", "gloo", timeout_s=60)
        second = receiver.receive(names, dtypes, shapes, "group_b", None)
        results.put((role, portable(second)))
        receiver.destroy("group_b")
    except Exception as error:  # reported, so the test fails with the cause
        results.put((role, repr(error)))


@pytest.mark.distributed
def test_a_regroup_without_a_dead_engine_runs_on_sglangs_own_code():
    """The pool's regroup (rollout/supervisor.py): an engine dies after a sync; the sender
    leaves its group without calling anyone (WeightTransport.leave), the engine that stays
    destroys the old group by name, and both form a group under a fresh name on another port,
    where the next bucket arrives intact."""
    ctx = mp.get_context("spawn")
    results, regroup = ctx.Queue(), ctx.Event()
    ports = (free_port(), free_port())
    procs = {
        role: ctx.Process(target=sglang_regroup_rank, args=(role, ports, regroup, results))
        for role in ("stays", "dies")
    }
    for proc in procs.values():
        proc.start()
    try:
        group_a = create_weight_update_group("127.0.0.1", ports[0], 3, "group_a", "gloo", 60)
        for _, tensor in bucket():
            group_a.broadcast(tensor)
        role, first = results.get(timeout=120)
        assert role == "dies", first
        procs["dies"].join(timeout=60)
        assert procs["dies"].exitcode == 0
        group_a.destroy()  # the sender's side, no engine called
        regroup.set()
        group_b = broadcast_bucket_to(ports[1], 2, "group_b")
        role, second = results.get(timeout=120)
        group_b.destroy()
    finally:
        stop_all(procs)
    assert role == "stays", second
    for got in (restored(first), restored(second)):
        assert_is_the_bucket(got)


@pytest.mark.distributed
def test_a_hand_built_prefix_store_sender_never_meets_sglang():
    """Negative control: TCPStore -> PrefixStore(name) -> ProcessGroupGloo, as the project's
    sender was built before, times out against SGLang's init_custom_process_group."""
    import torch.distributed as dist

    ctx = mp.get_context("spawn")
    results, port = ctx.Queue(), free_port()
    proc = ctx.Process(target=sglang_rank_alone, args=(port, results))
    proc.start()
    timeout = datetime.timedelta(seconds=4)
    store = dist.TCPStore(
        "127.0.0.1", port, 2, is_master=True, timeout=timeout, wait_for_workers=False
    )
    with pytest.raises(RuntimeError, match="timeout"):
        dist.ProcessGroupGloo(dist.PrefixStore(GROUP, store), 0, 2, timeout)
    assert results.get(timeout=60) != "joined"
    proc.join(timeout=60)


BIG = 8_000_000  # float32 elements (32 MB): far more than a socket buffer holds


def sglang_receiver_of_a_big_tensor(role: str, ports: tuple[int, int], started, results) -> None:
    """A TP1 SGLang server with SGLang's own join, receive and group code. Both join group A
    and start receiving a big tensor; the test stops and kills "dies" while the sender is
    still in that broadcast. "stays" reports how its receive ended, destroys group A (the
    pool's reconnect asks it to), joins group B under a fresh name and receives the bucket."""
    from megatron_fr.engine.sglang.source import DistributedReceiver

    receiver = DistributedReceiver()
    try:
        offset = 1 if role == "stays" else 2
        receiver.join("127.0.0.1", ports[0], offset, 3, "group_a", "gloo", timeout_s=60)
        started.put(role)
        try:
            receiver.receive(["big"], ["float32"], [[BIG]], "group_a", None)
            ended = "complete"
        except RuntimeError as error:
            ended = f"failed: {error}"[:200]
        if role == "dies":
            return
        results.put(("first", ended))
        assert receiver.destroy("group_a")
        receiver.join("127.0.0.1", ports[1], 1, 2, "group_b", "gloo", timeout_s=60)
        names = [name for name, _ in bucket()]
        dtypes = [str(t.dtype).removeprefix("torch.") for _, t in bucket()]
        shapes = [list(t.shape) for _, t in bucket()]
        second = receiver.receive(names, dtypes, shapes, "group_b", None)
        results.put(("second", portable(second)))
        receiver.destroy("group_b")
    except Exception as error:  # reported, so the test fails with the cause
        results.put(("error", repr(error)))


@pytest.mark.distributed
def test_a_receiver_killed_mid_broadcast_fails_the_collective_not_the_learner():
    """A receiver stopped inside a broadcast holds the sender there (the tensor is far larger
    than the socket buffers); killed, it fails the sender's collective within the group's
    timeout instead of taking the process down: CollectiveFailed, the group aborted (no
    graceful destroy that would wait on the stalled collective). The receiver that stays
    leaves the old group and forms a fresh one with the sender, where the next bucket arrives
    intact, all on SGLang's own receiving code."""
    import signal
    import threading
    import time

    from megatron_fr.engine.group import CollectiveFailed

    ctx = mp.get_context("spawn")
    started, results = ctx.Queue(), ctx.Queue()
    ports = (free_port(), free_port())
    procs = {
        role: ctx.Process(
            target=sglang_receiver_of_a_big_tensor, args=(role, ports, started, results)
        )
        for role in ("stays", "dies")
    }
    for proc in procs.values():
        proc.start()
    outcome: list[BaseException | None] = []
    try:
        group_a = create_weight_update_group("127.0.0.1", ports[0], 3, "group_a", "gloo", 30)
        assert {started.get(timeout=60), started.get(timeout=60)} == {"stays", "dies"}
        os.kill(procs["dies"].pid, signal.SIGSTOP)

        def send() -> None:
            try:
                group_a.broadcast(torch.ones(BIG))
                outcome.append(None)
            except CollectiveFailed as error:
                outcome.append(error)

        sender = threading.Thread(target=send, daemon=True)
        began = time.monotonic()
        sender.start()
        sender.join(timeout=3)
        assert sender.is_alive(), "the broadcast finished past a stopped receiver"
        os.kill(procs["dies"].pid, signal.SIGKILL)
        sender.join(timeout=60)
        failed_after = time.monotonic() - began
        assert not sender.is_alive(), "the broadcast never returned"
        assert isinstance(outcome[0], CollectiveFailed), outcome
        assert not group_a.usable  # aborted: a second use is refused, nothing waits on it
        with pytest.raises(CollectiveFailed):
            group_a.broadcast(torch.ones(1))
        kind, first = results.get(timeout=90)
        assert kind == "first", first
        group_b = broadcast_bucket_to(ports[1], 2, "group_b")
        kind, second = results.get(timeout=120)
        group_b.destroy()
    finally:
        stop_all(procs)
    assert kind == "second", second
    print(f"\ncollective failed {failed_after:.1f} s after it began; the survivor's: {first}")
    assert failed_after < 30  # within the group's timeout
    assert_is_the_bucket(restored(second))
