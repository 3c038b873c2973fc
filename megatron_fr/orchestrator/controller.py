"""The training loop of a run, on every learner rank (one process each, under torchrun).

    first rank:       the Leader (orchestrator/ranks.py): the rollout process (running the
                      RolloutService: engines, buffer + prompt cursor, episodes, eval) and
                      the RunReport (metrics.jsonl, TensorBoard, batches.jsonl); every other
                      rank a Follower, with the same interface and none of them
    every rank:       the step's plan and its DP share's trajectories (the rollout process
                      sends each (DP, PP) stage leader its share; the leader broadcasts it
                      within its TP x CP ranks: learner/delivery.py)
                      ─► Learner.train_share ─► version += 1
                      ─► PoolSync: WeightSync (pause, buckets, version, continue;
                         collectives) to the engines in the pool, reconnected when it changed
                      ─► leader: buffer version, report, eval ─► checkpoint

What waits on what: the learner waits only for a fresh batch (buffer.get_batch); rollouts wait
only on the buffer's admission budget ((max_lag + 1) * B, buffer/lag_buffer.py), which the
version bump after each sync opens again. An engine that dies or hangs leaves the pool and the
run goes on (rollout/supervisor.py, orchestrator/pool_sync.py); a failure of the rollout
service itself (an engine past its restart budget, a bug in a reward) wakes that wait with its
cause and ends the run. A restart with the
same command resumes from the newest checkpoint whose files are all readable
(orchestrator/resume.py).
"""

from __future__ import annotations

import functools
import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from megatron_fr.config.run import RunConfig
from megatron_fr.learner.delivery import DataPathAddress, ShareReceiver
from megatron_fr.orchestrator import checkpoints as ckpt
from megatron_fr.orchestrator.manifest import write_manifest
from megatron_fr.orchestrator.pool_sync import WAIT_S, PoolSync, StopRequested
from megatron_fr.orchestrator.ranks import Follower, Leader, Rank
from megatron_fr.orchestrator.resume import NoUsableCheckpoint, settle_resume_point
from megatron_fr.orchestrator.setup import connect_weight_sync
from megatron_fr.parallel.state import broadcast_from_rank0
from megatron_fr.rollout.service import RolloutFailed
from megatron_fr.rollout.supervisor import EngineDied
from megatron_fr.utils.cleanup import close_in_order
from megatron_fr.utils.gpu_telemetry import GpuTelemetry
from megatron_fr.utils.net import free_port
from megatron_fr.weights.sync import SyncInterrupted, WeightSyncError
from megatron_fr.weights.verify import SyncCheck

if TYPE_CHECKING:
    from megatron_fr.learner.step_metrics import StepMetrics
    from megatron_fr.learner.trainer import Learner
    from megatron_fr.models.hf_config import HFModelSpec


def train(config: RunConfig, run_dir: Path) -> None:
    from megatron_fr.learner.trainer import Learner
    from megatron_fr.models.hf_config import load_hf_config
    from megatron_fr.parallel import state

    state.initialize(config.parallel, seed=config.seed)
    first = dist.get_rank() == 0
    hf_dir = Path(config.model.hf_dir)  # checked by the preflight (orchestrator/check.py)
    spec = load_hf_config(json.loads((hf_dir / "config.json").read_text()))
    resume_from, set_aside = settled_resume_point(run_dir)
    # A fresh run reads its shards of the HF checkpoint directly; a resumed one its own.
    learner = Learner(
        spec,
        config.parallel,
        config.learner,
        total_steps=config.steps,
        init_hf_dir=None if resume_from else str(hf_dir),
        temperature=config.rollout.temperature,
        spec_kind=config.model.spec,
    )
    if resume_from is not None:
        learner.load(str(resume_from / "learner"))
        ckpt.load_rng(resume_from, dist.get_rank())
    rank: Rank = Follower()
    weight_sync = None
    try:
        if first:
            address = data_path_address(config, learner)
            resume_point = (learner.steps_done, set_aside)
            rank = Leader.start(config, (hf_dir, run_dir), address, resume_from, resume_point)
        hello = rank.share(lambda lead: lead.hello)
        replay = learner.routing_replay
        receiver = ShareReceiver(
            learner.groups, hello.address, None if replay is None else replay.stage_layers
        )
        weight_sync = connect_weight_sync(config, hello.urls, spec, run_dir, learner.groups)
        check = sync_check(config, learner, spec, hello.pad_id)
        pool = PoolSync(config, weight_sync, rank, check)
        pool.sync(learner.module, learner.steps_done)  # the engines serve the learner's weights
        rank.act(lambda lead: lead.rollout.start())
        _loop(config, run_dir, learner, pool, receiver, hello.pad_id, rank)
    except Exception as error:
        # A dead engine is named, not the socket it broke.
        rank.act(functools.partial(Leader.explain, error=error))
        raise
    finally:  # the senders leave the weight-update groups; a failure to close hides nothing
        close_in_order(
            [("weight sync", weight_sync.close if weight_sync else None), *rank.closers()]
        )


def sync_check(config: RunConfig, learner: Learner, spec: HFModelSpec, pad_id: int) -> SyncCheck:
    """The check after each weight sync (weights/verify.py), scored by the learner with its
    own routing at the rollouts' temperature. Under the top-K gate the probe asks the engines
    for the gate's top-K too: the learner's step plan wants them on every trajectory."""
    gate = config.learner.flash_reinforce
    settings = config.weights
    return SyncCheck(
        functools.partial(learner.policy_log_probs, pad_id=pad_id, routing_replay=False),
        spec.vocab_size,
        config.rollout.temperature,
        settings.verify_every,
        settings.verify_tolerance,
        settings.timeout_s,
        top_logprobs_num=gate.gate_top_k if gate.gate_kl == "topk" else 0,
    )


def data_path_address(config: RunConfig, learner: Learner) -> DataPathAddress:
    """Where the rollout process hosts the data group: this node, at data_path_host, a free
    port, one member per (DP rank, PP stage). Its waits are the learner's collective timeout:
    a stage leader waits there for each batch."""
    leaders = learner.groups.dp.size() * learner.groups.pp.size()
    host = data_path_host(config, dist.get_world_size())
    return DataPathAddress(host, free_port(), leaders, config.parallel.timeout_minutes * 60.0)


def data_path_host(
    config: RunConfig, world_size: int, environ: Mapping[str, str] = os.environ
) -> str:
    """parallel.data_address, else loopback when the whole learner is on this node, else
    the launcher's MASTER_ADDR (the node of rank 0); never this host's name, which resolves
    to a loopback address on many distributions."""
    if config.parallel.data_address:
        return config.parallel.data_address
    if environ.get("LOCAL_WORLD_SIZE") == str(world_size):
        return "127.0.0.1"
    if environ.get("MASTER_ADDR"):
        return environ["MASTER_ADDR"]
    raise ValueError(
        "the learner spans nodes and neither parallel.data_address nor MASTER_ADDR says where "
        "its first rank is: set parallel.data_address to that node's address"
    )


def _loop(
    config: RunConfig,
    run_dir: Path,
    learner: Learner,
    pool: PoolSync,
    receiver: ShareReceiver,
    pad_id: int,
    rank: Rank,
) -> None:
    """The steps from the learner's, to config.steps or a STOP request: a STOP seen after a
    step ends the run there; one seen while the learner waits (a batch, an evaluation) ends it
    at the step reached, checkpointed unless its checkpoint exists already."""
    step = saved = learner.steps_done
    telemetry = GpuTelemetry()
    rank.act(lambda lead: lead.stop_file.unlink(missing_ok=True))  # for the run that saw it
    try:
        if step == 0:
            evaluate(rank, pool, learner.module, step)
        skipped = SkippedSteps(config.learner.max_nonfinite_steps, say=rank.leads)
        while step < config.steps:
            started = time.monotonic()
            summaries = pool.wait_for_batch(step, learner.module)
            plan, shard = receiver.receive()
            metrics = learner.train_share(plan, shard.rows(), pad_id=pad_id)
            step += 1
            # A skipped step changed no weight: the engines keep theirs. A STOP that gave up
            # the sync (an engine hung in it) stops the run once the step is logged and saved.
            interrupted = False
            try:
                sync_s = 0.0 if skipped.count(step, metrics) else pool.sync(learner.module, step)
            except SyncInterrupted:
                sync_s, interrupted = 0.0, True
            last = step == config.steps
            figures = gather_telemetry(telemetry) | pool.check_metrics()
            rank.act(
                functools.partial(
                    Leader.report_step,
                    step=step,
                    summaries=summaries,
                    metrics=(metrics, figures),
                    sync_s=sync_s,
                    started=started,
                )
            )
            evaluates = last or (config.eval.every_steps and step % config.eval.every_steps == 0)
            if evaluates and not interrupted:
                evaluate(rank, pool, learner.module, step)
            stop = interrupted or rank.share(Leader.stop_requested)
            if last or stop or step % config.checkpoint.every_steps == 0:
                save_checkpoint(config, run_dir, learner, rank, step)
                saved = step
            if stop and not last:
                rank.act(functools.partial(stopped, step=step, saved=True))
                return
    except StopRequested:
        if step != saved:
            save_checkpoint(config, run_dir, learner, rank, step)
        rank.act(functools.partial(stopped, step=step, saved=step != 0))


def stopped(lead: Leader, step: int, saved: bool) -> None:
    """The leader's part of a stop on request: the request is consumed, the stop said."""
    lead.stop_file.unlink(missing_ok=True)
    kept = "checkpoint saved" if saved else "nothing to save: the next start begins afresh"
    print(f"stopped on request at step {step} ({kept})", flush=True)


class NonFiniteSteps(RuntimeError):
    """Too many steps in a row had a non-finite loss or gradient."""


class SkippedSteps:
    """The steps the learner skipped for a non-finite loss or gradient (learner/nonfinite.py):
    each is said and counted (metrics' step_skipped, skipped_steps_total), and `limit` in a
    row end the run: the weights never change, so nothing would."""

    def __init__(self, limit: int, say: bool) -> None:
        self.limit, self.say = limit, say
        self.in_a_row = self.total = 0

    def count(self, step: int, metrics: StepMetrics) -> bool:
        """Whether the step was skipped (sets its metrics); NonFiniteSteps at the limit."""
        cause = metrics["nonfinite"]
        self.in_a_row = self.in_a_row + 1 if cause else 0
        self.total += bool(cause)
        metrics["step_skipped"], metrics["skipped_steps_total"] = float(bool(cause)), self.total
        if cause and self.in_a_row >= self.limit:
            raise NonFiniteSteps(
                f"the last {self.in_a_row} steps (to step {step}) had a non-finite {cause}: "
                f"none updated the weights (learner.max_nonfinite_steps={self.limit}); lower "
                "learner.lr or look for non-finite rewards or log-probs in the batches"
            )
        if cause and self.say:
            print(
                f"step {step} skipped: its {cause} is not finite (no weight changed, none "
                f"sent; {self.in_a_row} in a row)",
                flush=True,
            )
        return bool(cause)


RUN_ENDINGS: tuple[type[Exception], ...] = (
    EngineDied,
    RolloutFailed,
    NoUsableCheckpoint,
    NonFiniteSteps,
    WeightSyncError,
)
"""The errors that end a run for a reason its message states in full (an engine out of
restarts, no usable checkpoint, the learner's steps non-finite, a weight sync refused): the
rank that meets one prints that message, not a traceback of the run loop."""


def settled_resume_point(run_dir: Path) -> tuple[Path | None, int]:
    """Every rank: the checkpoint to resume from (None: a fresh start) and how many newer ones
    were set aside as unusable. The first rank checks the files and decides before any rank
    loads one (orchestrator/resume.py), so no rank meets a bad file inside a collective load;
    when none is usable every rank raises the same error."""
    first = dist.get_rank() == 0
    decision = settle_resume_point(run_dir, dist.get_world_size()) if first else None
    path, set_aside, error = broadcast_from_rank0(decision)
    if error is not None:
        raise NoUsableCheckpoint(error)
    return (Path(path) if path else None), set_aside


def gather_telemetry(telemetry: GpuTelemetry) -> dict[str, float]:
    """Every rank's GPU figures of this step, keyed gpu<rank>_<metric> (empty without NVML)."""
    sample = telemetry.sample()
    if not sample:
        return {}
    everyone: list[dict[str, float]] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(everyone, sample)
    return {
        f"gpu{rank}_{key[4:]}": value
        for rank, part in enumerate(everyone)
        for key, value in part.items()
    }


def evaluate(rank: Rank, pool: PoolSync, model: torch.nn.Module, step: int) -> None:
    """avg@k on every held-out set, at the eval's own sampling temperature: the leader's
    rollout process evaluates while every rank waits with the pool cared for (PoolSync.wait:
    an engine restarted meanwhile gets the weights of `step` and serves the rest of it)."""
    rank.act(lambda lead: lead.rollout.begin_held_out_evaluation())
    result = pool.wait(lambda lead: lead.rollout.held_out_evaluation(WAIT_S), model, step)
    if result is not None:  # the leader's
        rank.act(lambda lead: lead.report.evaluation(step, *result))


def wait_slice_s(config: RunConfig) -> float:
    """How long a rank waits for the first rank in one collective: a quarter of the
    collective timeout, at most a minute."""
    return min(60.0, config.parallel.timeout_minutes * 60 / 4)


def save_checkpoint(
    config: RunConfig, run_dir: Path, learner: Learner, rank: Rank, step: int
) -> None:
    directory = ckpt.step_dir(run_dir, step)
    learner.save(str(directory / "learner"))
    ckpt.save_rng(directory, dist.get_rank())

    def controller_state(lead: Leader) -> None:
        ckpt.save_controller_state(directory, {"step": step, "rollout": lead.rollout.state_dict()})

    def seal(_: Leader) -> None:  # every rank's files are written: the manifest last makes it whole
        write_manifest(directory)
        ckpt.mark_latest(run_dir, directory, config.checkpoint.keep)

    slice_s = wait_slice_s(config)
    rank.run(controller_state, slice_s)
    rank.run(seal, slice_s)  # hashing may take minutes
