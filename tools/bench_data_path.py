#!/usr/bin/env python
"""A flagship-shaped batch delivered to the learner ranks: the whole batch to every rank (the
old path) against each replica's share (the data path: megatron_fr/learner/delivery.py).

    .venv/bin/python tools/bench_data_path.py                 # 8 CPU ranks, DP4 x TP2
    .venv/bin/python tools/bench_data_path.py --trajectories 32 --median 2048 --json

The batch: B trajectories with lognormal lengths capped at the flagship's 18,432-token rows, a
prompt of 512 tokens and the rest policy tokens, routed experts of Qwen3-30B-A3B (48 layers x
top-8 of 128 experts: 384 bytes a token, uint8). Three deliveries, each timed from a barrier of
all ranks to a barrier after every rank holds what it needs:
  lists      rank 0 broadcasts the batch as the code used to hold it (per-token Python lists,
             routing as a uint8 array) with broadcast_object_list (pickled) to every rank
  arrays     the same with per-token numpy arrays (buffer/trajectory.py today)
  shares     a separate process (the rollout service's place) plans the step and sends each
             stage leader (DP rank, TP 0) its share with ShareSender; each leader broadcasts it
             to its TP peer (ShareReceiver)
Bytes per rank are what each rank received: the pickled batch, or the plan and the share.
Prints `bytes per rank / whole batch: X` (the largest share over the lists payload) and
`delivery time new / old: Y` (shares over lists).
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import pickle
import time
from dataclasses import dataclass

import numpy as np
import torch

from megatron_fr.buffer.trajectory import NON_POLICY_VERSION, Trajectory
from megatron_fr.engine.routing import RoutedExperts
from megatron_fr.parallel.spawn import run_on_ranks
from megatron_fr.utils.net import free_port

PROMPT = 512
LAYERS, TOP_K, EXPERTS = 48, 8, 128


@dataclass
class ListTrajectory:
    """A trajectory as the code held it before the arrays: a Python object per token."""

    prompt_id: str
    token_ids: list
    action_mask: list
    behavior_log_probs: list
    token_versions: list
    reward: float
    info: dict
    routed_experts: RoutedExperts | None


def make_batch(args: argparse.Namespace) -> list[Trajectory]:
    rng = np.random.default_rng(args.seed)
    lengths = np.exp(math.log(args.median) + args.sigma * rng.standard_normal(args.trajectories))
    batch = []
    for k, length in enumerate(np.clip(lengths.round(), PROMPT + 16, args.max_length).astype(int)):
        mask = np.zeros(length, dtype=bool)
        mask[PROMPT:] = True
        experts = np.stack([rng.permutation(EXPERTS)[:TOP_K] for _ in range(LAYERS)])
        routing = np.broadcast_to(experts, (length - 1, LAYERS, TOP_K)).astype(np.uint8)
        batch.append(
            Trajectory(
                prompt_id=f"p{k}",
                token_ids=rng.integers(0, 151_936, length, dtype=np.int32),
                action_mask=mask,
                behavior_log_probs=np.where(mask, -rng.random(length, dtype=np.float32), 0.0),
                token_versions=np.where(mask, 3, NON_POLICY_VERSION).astype(np.int32),
                reward=float(k % 2),
                info={"group": f"p{k}"},
                routed_experts=RoutedExperts(np.ascontiguousarray(routing), EXPERTS),
            )
        )
    return batch


def as_lists(batch: list[Trajectory]) -> list[ListTrajectory]:
    return [
        ListTrajectory(
            t.prompt_id,
            t.token_ids.tolist(),
            t.action_mask.tolist(),
            t.behavior_log_probs.tolist(),
            t.token_versions.tolist(),
            t.reward,
            t.info,
            t.routed_experts,
        )
        for t in batch
    ]


def learner_config(args: argparse.Namespace):
    from megatron_fr.config.learner import LearnerConfig
    from megatron_fr.config.parallel import ParallelConfig

    parallel = ParallelConfig(tensor=args.tp, sequence_parallel=args.tp > 1)
    return LearnerConfig(micro_batch_tokens=args.max_length + 64), parallel


def service(args: argparse.Namespace, port: int, rounds: int) -> None:
    """The rollout service's part: plan each batch and send the shares."""
    from megatron_fr.learner.delivery import DataPathAddress, ShareSender
    from megatron_fr.learner.step_plan import plan_step

    batch = make_batch(args)
    config, parallel = learner_config(args)
    sender = ShareSender(DataPathAddress("127.0.0.1", port, args.ranks // args.tp))
    for _ in range(rounds):
        go = torch.empty(1, dtype=torch.int64)
        sender.group.recv([go], 1, 0).wait()  # the first stage leader says the ranks are ready
        works, _ = sender.send(batch, plan_step(batch, config, parallel, args.ranks // args.tp))
        for work in works:
            work.wait()


def rank_main(rank: int, world: int, args: argparse.Namespace, port: int) -> dict:
    import torch.distributed as dist

    from megatron_fr.learner.delivery import DataPathAddress, ShareReceiver
    from megatron_fr.parallel import state

    _, parallel = learner_config(args)
    state.initialize(parallel)
    address = DataPathAddress("127.0.0.1", port, world // args.tp)
    receiver = ShareReceiver(state.process_groups(), address, slice(0, LAYERS))
    batch = make_batch(args) if rank == 0 else None
    out = {}
    for name, payload in (("lists", as_lists(batch) if batch else None), ("arrays", batch)):
        times = []
        for _ in range(args.rounds):
            holder = [payload]
            dist.barrier()
            start = time.perf_counter()
            dist.broadcast_object_list(holder, src=0)
            dist.barrier()
            times.append(time.perf_counter() - start)
        out[name] = (min(times), len(pickle.dumps(holder[0], protocol=pickle.HIGHEST_PROTOCOL)))
        del holder
    times = []
    for _ in range(args.rounds):
        dist.barrier()
        start = time.perf_counter()
        if rank == 0:  # the first stage leader: the service may send now
            receiver.data_group.send([torch.ones(1, dtype=torch.int64)], 0, 0).wait()
        plan, shard = receiver.receive()
        rows = shard.rows()
        dist.barrier()
        times.append(time.perf_counter() - start)
    assert sorted(rows) == plan.share(state.process_groups().dp.rank())
    out["shares"] = (min(times), len(pickle.dumps(plan)) + 8 + shard.nbytes)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trajectories", type=int, default=128, help="batch size B")
    parser.add_argument("--median", type=float, default=6144, help="median length (tokens)")
    parser.add_argument("--sigma", type=float, default=0.8, help="lognormal sigma of lengths")
    parser.add_argument("--max-length", type=int, default=18432, help="longest row")
    parser.add_argument("--ranks", type=int, default=8, help="learner ranks")
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size (DP = ranks/TP)")
    parser.add_argument("--rounds", type=int, default=2, help="deliveries of each kind (min)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    port = free_port()
    sender = mp.get_context("spawn").Process(target=service, args=(args, port, args.rounds))
    sender.start()
    try:
        results = run_on_ranks(rank_main, args.ranks, args, port, timeout_s=1800)
    finally:
        sender.join(timeout=60)
        if sender.is_alive():
            sender.kill()
    report = summarise(results, args)
    print(json.dumps(report, indent=1) if args.json else render(report))
    return 0


def summarise(results: list[dict], args: argparse.Namespace) -> dict:
    whole = results[0]["lists"][1]
    report = {
        "ranks": args.ranks,
        "tp": args.tp,
        "dp": args.ranks // args.tp,
        "trajectories": args.trajectories,
    }
    for name in ("lists", "arrays", "shares"):
        report[name] = {
            "seconds": max(r[name][0] for r in results),
            "bytes_per_rank_max": max(r[name][1] for r in results),
        }
    report["bytes_per_rank_over_whole_batch"] = report["shares"]["bytes_per_rank_max"] / whole
    report["time_new_over_old"] = report["shares"]["seconds"] / report["lists"]["seconds"]
    return report


def render(report: dict) -> str:
    lines = [
        f"{report['ranks']} ranks (DP{report['dp']} x TP{report['tp']}), "
        f"{report['trajectories']} trajectories"
    ]
    for name in ("lists", "arrays", "shares"):
        part = report[name]
        lines.append(
            f"  {name:7} {part['seconds']:8.3f} s   "
            f"{part['bytes_per_rank_max'] / 2**20:9.1f} MiB per rank"
        )
    lines.append(f"bytes per rank / whole batch: {report['bytes_per_rank_over_whole_batch']:.3f}")
    lines.append(f"delivery time new / old: {report['time_new_over_old']:.3f}")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
