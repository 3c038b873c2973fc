"""Run a function on N local ranks (one process each) with torch.distributed initialised.

Used by the multi-process tests and the CPU tools: every rank runs ``fn(rank, world_size,
*args)`` after ``init_process_group`` on a free loopback port, and the caller gets back each
rank's return value in rank order, or a RankFailure carrying every failing rank's traceback.
A rank is a program's entry point: it installs the CPU shims megatron needs without CUDA
(parallel/cpu_shims.py) before it runs ``fn``.
Processes are started with the "spawn" method (safe with torch threads) and, whatever happens,
stopped by their own handles before this returns.
"""

from __future__ import annotations

import io
import os
import queue
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_fr.parallel.cpu_shims import install_cpu_shims
from megatron_fr.utils.net import free_port


class RankFailure(RuntimeError):
    """One or more ranks raised (or died); the message holds each rank's traceback."""

    def __init__(self, failures: dict[int, str]):
        self.failures = failures
        text = "\n".join(f"--- rank {rank} ---\n{tb}" for rank, tb in sorted(failures.items()))
        super().__init__(f"{len(failures)} rank(s) failed:\n{text}")


def _rank_main(
    rank: int,
    world_size: int,
    port: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    results: Any,
    threads: int,
) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(threads)
    try:
        install_cpu_shims()
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        results.put((rank, True, _to_bytes(fn(rank, world_size, *args))))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        _teardown()


def _to_bytes(value: Any) -> bytes:
    """Serialise a rank's result: tensors put on a queue as-is are shared through file
    descriptors that die with the rank process, before the parent reads them."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _from_bytes(payload: bytes) -> Any:
    return torch.load(io.BytesIO(payload), weights_only=False)


def _teardown() -> None:
    """Destroy megatron's groups (if this rank built them) and the default group."""
    try:
        parallel_state = sys.modules.get("megatron.core.parallel_state")
        if parallel_state is not None and parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_on_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 600.0,
    threads_per_rank: int = 1,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return results by rank.

    ``fn`` and ``args`` must be picklable (a module-level function). Raises RankFailure if any
    rank raised, exited without reporting, or did not finish within ``timeout_s``.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    # Not daemonic: a rank may start processes of its own (megatron's checkpoint writer starts
    # a multiprocessing Manager); the finally below stops every rank by its handle instead.
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(rank, world_size, port, fn, args, results, threads_per_rank),
            daemon=False,
        )
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    outcomes: dict[int, tuple[bool, Any]] = {}
    try:
        outcomes = _collect(results, procs, timeout_s)
    finally:
        for proc in procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()
    failures = {rank: payload for rank, (ok, payload) in outcomes.items() if not ok}
    if failures:
        raise RankFailure(failures)
    return [_from_bytes(outcomes[rank][1]) for rank in range(world_size)]


def _collect(results: Any, procs: list[Any], timeout_s: float) -> dict[int, tuple[bool, Any]]:
    """Gather (ok, payload) per rank until all reported, a rank failed, or time ran out.

    A failed rank usually leaves its peers blocked in a collective, so after the first failure
    the others get a short grace period to report and are then marked as stopped.
    """
    deadline = time.monotonic() + timeout_s
    outcomes: dict[int, tuple[bool, Any]] = {}
    while len(outcomes) < len(procs) and time.monotonic() < deadline:
        try:
            rank, ok, payload = results.get(timeout=1.0)
            outcomes[rank] = (ok, payload)
        except queue.Empty:
            pass
        silent_deaths = [
            r for r, p in enumerate(procs) if r not in outcomes and p.exitcode is not None
        ]
        if silent_deaths or any(not ok for ok, _ in outcomes.values()):
            _drain(results, outcomes, seconds=3.0)
            for rank in silent_deaths:
                outcomes.setdefault(rank, (False, f"died with exit code {procs[rank].exitcode}"))
            break
    for rank in range(len(procs)):
        if rank not in outcomes:
            reason = (
                "stopped after another rank failed"
                if time.monotonic() < deadline
                else (f"timed out after {timeout_s:.0f} s")
            )
            outcomes[rank] = (False, reason)
    return outcomes


def _drain(results: Any, outcomes: dict[int, tuple[bool, Any]], seconds: float) -> None:
    try:
        while True:
            rank, ok, payload = results.get(timeout=seconds)
            outcomes[rank] = (ok, payload)
    except queue.Empty:
        pass
