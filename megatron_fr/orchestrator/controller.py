"""The training loop of a run, on every learner rank (one process each, under torchrun).

    first rank only:  RolloutService (engines, buffer + prompt cursor, episodes, eval) and
                      RunReport (metrics.jsonl, TensorBoard, batches.jsonl); None elsewhere
    every rank:       get batch (the first rank waits on the buffer, broadcasts)
                      ─► Learner.train_step ─► version += 1
                      ─► WeightSync (pause, buckets, version, continue; collectives)
                      ─► first rank: buffer version, report, eval ─► checkpoint

What waits on what: the learner waits only for a fresh batch (buffer.get_batch); rollouts wait
only on the buffer's admission budget ((max_lag + 1) * B, buffer/lag_buffer.py), which the
version bump after each sync opens again. A failure anywhere in the rollout service (a dead
engine, a bug in a reward) wakes that wait with its cause and ends the run. A restart with the
same command resumes from the newest complete checkpoint (orchestrator/checkpoints.py).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch.distributed as dist

from megatron_fr.config.run import RunConfig
from megatron_fr.orchestrator import checkpoints as ckpt
from megatron_fr.orchestrator.report import RunReport
from megatron_fr.orchestrator.setup import (
    build_rollout_service,
    connect_weight_sync,
    eval_sets,
)
from megatron_fr.parallel.state import broadcast_from_rank0
from megatron_fr.rollout.service import RolloutService
from megatron_fr.utils.gpu_telemetry import GpuTelemetry

STOP_FILE = "STOP"
"""Created in the run directory (by a Slurm USR1 trap, or by hand), it ends the run after the
current step with a checkpoint of that step; the same command then resumes from there."""


def train(config: RunConfig, run_dir: Path) -> None:
    from megatron_fr.learner.trainer import Learner
    from megatron_fr.models.hf_config import load_hf_config
    from megatron_fr.parallel import state

    state.initialize(config.parallel, seed=config.seed)
    first = dist.get_rank() == 0
    hf_dir = Path(config.model.hf_dir)  # checked by the preflight (orchestrator/check.py)
    spec = load_hf_config(json.loads((hf_dir / "config.json").read_text()))
    resume_from = ckpt.latest_checkpoint(run_dir)
    # A fresh run reads its shards of the HF checkpoint directly; a resumed one its own.
    learner = Learner(spec, config.parallel, config.learner, total_steps=config.steps,
                      init_hf_dir=None if resume_from else str(hf_dir),
                      temperature=config.rollout.temperature,
                      spec_kind=config.model.spec)  # fmt: skip
    if resume_from is not None:
        learner.load(str(resume_from / "learner"))
        ckpt.load_rng(resume_from, dist.get_rank())
    service = report = weight_sync = None
    try:
        if first:
            for path in ckpt.discard_after_latest(run_dir):
                print(f"deleted {path}: written after the last complete checkpoint", flush=True)
            service = build_rollout_service(config, hf_dir, run_dir)
            if resume_from is not None:
                service.load_state_dict(ckpt.load_controller_state(resume_from)["rollout"])
                print(f"resumed from {resume_from} (step {learner.steps_done})", flush=True)
            report = RunReport(config, run_dir, learner.steps_done)
        urls, pad_id = broadcast_from_rank0(
            (service.engines.urls, service.producer.pad_id) if service else None
        )
        weight_sync = connect_weight_sync(config, urls, spec, run_dir)
        weight_sync.sync(learner.module, learner.steps_done)  # engines serve the learner's weights
        if service is not None:
            service.start()
        _loop(config, run_dir, learner, weight_sync, pad_id, service, report)
    except Exception as error:
        if service is not None:
            service.explain(error)  # a dead engine is named, not the socket it broke
        raise
    finally:
        if weight_sync is not None:
            weight_sync.close()  # the senders leave the weight-update groups
        if service is not None:
            service.close()
        if report is not None:
            report.close()


def _loop(config, run_dir, learner, weight_sync, pad_id, service, report) -> None:
    step = learner.steps_done
    stop_file = run_dir / STOP_FILE
    telemetry = GpuTelemetry()
    if service is not None:
        stop_file.unlink(missing_ok=True)  # a request is for the run that saw it, not a rerun
        if step == 0:
            evaluate(config, service, report, step)
    while step < config.steps:
        started = time.monotonic()
        batch = broadcast_from_rank0(service.next_batch(step) if service else None)
        metrics = learner.train_step(batch, pad_id=pad_id)
        step += 1
        sync = weight_sync.sync(learner.module, step)
        gpus = gather_telemetry(telemetry)
        last = step == config.steps
        if service is not None:
            service.set_version(step)
            seconds = time.monotonic() - started
            report.step(step, batch, metrics | gpus, sync.seconds, service.stats(), seconds)
            if last or (config.eval.every_steps and step % config.eval.every_steps == 0):
                evaluate(config, service, report, step)
        stop = broadcast_from_rank0(stop_file.exists() if service else None)
        if last or stop or step % config.checkpoint.every_steps == 0:
            save_checkpoint(config, run_dir, learner, service, step)
        if stop and not last:
            if service is not None:
                stop_file.unlink(missing_ok=True)
                print(f"stopped on request at step {step} (checkpoint saved)", flush=True)
            return


def gather_telemetry(telemetry: GpuTelemetry) -> dict[str, float]:
    """Every rank's GPU figures of this step, keyed gpu<rank>_<metric> (empty without NVML)."""
    sample = telemetry.sample()
    if not sample:
        return {}
    everyone: list[dict[str, float]] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(everyone, sample)
    return {f"gpu{rank}_{key[4:]}": value for rank, part in enumerate(everyone)
            for key, value in part.items()}  # fmt: skip


def evaluate(config: RunConfig, service: RolloutService, report: RunReport, step: int) -> None:
    """avg@k on every held-out set, at the eval's own sampling temperature."""
    sampling = service.producer.sampling(config.eval.temperature, config.eval.top_p)
    results = service.evaluate(eval_sets(config, service.producer), sampling,
                               config.eval.timeout_s)  # fmt: skip
    report.evaluation(step, results, service.stats()["rollouts_total"])


def save_checkpoint(config: RunConfig, run_dir: Path, learner, service, step: int) -> None:
    directory = ckpt.step_dir(run_dir, step)
    learner.save(str(directory / "learner"))
    ckpt.save_rng(directory, dist.get_rank())
    if service is not None:
        ckpt.save_controller_state(directory, {"step": step, "rollout": service.state_dict()})
    dist.barrier()
    if service is not None:
        ckpt.mark_latest(run_dir, directory, config.checkpoint.keep)
