"""The training loop of a run, on every learner rank (one process each, under torchrun).

    rank 0 only:  PromptSource ─► RolloutWorkers (thread) ─► engine(s) ─► LagAwareBuffer
                                                                           │ batch of B
    every rank:   get batch (rank 0 waits on the buffer, broadcasts) ─► Learner.train_step
                  ─► version += 1 ─► WeightSync (pause, buckets, version, continue)
                  ─► rank 0: buffer.set_version, log, eval, checkpoint

What waits on what: the learner waits only for B fresh trajectories; the rollout workers
wait only on the buffer's admission budget ((max_lag + 1) * B, buffer/lag_buffer.py), which
the version bump after each sync opens again. A restart with the same command resumes from
the newest complete checkpoint (orchestrator/checkpoints.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import torch.distributed as dist

from megatron_fr.config.run import RunConfig
from megatron_fr.orchestrator import checkpoints as ckpt
from megatron_fr.orchestrator.session import RolloutSession
from megatron_fr.parallel.spawn import standalone_env
from megatron_fr.parallel.state import broadcast_from_rank0

REPO_TOOLS = Path(__file__).resolve().parents[2] / "tools"


def prepare_hf_model(config: RunConfig, run_dir: Path) -> Path:
    """The HF directory the engines serve first: model.hf_dir when the recipe names one,
    otherwise the task's tiny model warm-started into run_dir/warm_start (reused when made
    with the same settings). Runs in one process, before or without the learner ranks."""
    from megatron_fr.learner.warm_start import DEFAULT_WARM_START, warm_start
    from megatron_fr.tasks import build_task
    from megatron_fr.tasks.arithmetic import tiny_model_config

    if config.model.hf_dir:
        hf_dir = Path(config.model.hf_dir)
        if not (hf_dir / "config.json").is_file():
            raise FileNotFoundError(f"model.hf_dir {hf_dir}: no config.json there")
        return hf_dir
    hf_dir = run_dir / "warm_start"
    task = build_task(config.task.name, config.task.options)
    settings = DEFAULT_WARM_START | config.model.warm_start
    report = warm_start(hf_dir, task, tiny_model_config(), seed=config.seed, **settings)
    print(f"warm start: {report}", flush=True)
    return hf_dir


def prepare_model(config: RunConfig, run_dir: Path) -> tuple[Path, Path]:
    """(HF dir the engine serves first, megatron dir the learner starts from), made on rank 0."""
    hf_dir = prepare_hf_model(config, run_dir)
    megatron_dir = run_dir / "init_megatron"
    if not megatron_dir.exists():
        subprocess.run(
            [sys.executable, str(REPO_TOOLS / "convert_checkpoint.py"), "hf-to-megatron",
             "--hf-dir", str(hf_dir), "--out", str(megatron_dir)],
            check=True, stdout=subprocess.DEVNULL, env=standalone_env(),
        )  # fmt: skip
    return hf_dir, megatron_dir


def train(config: RunConfig, run_dir: Path) -> None:
    from megatron_fr.learner.trainer import Learner
    from megatron_fr.models.hf_config import load_hf_config
    from megatron_fr.parallel import state
    from megatron_fr.tasks import build_task

    state.initialize(config.parallel, seed=config.seed)
    rank0 = dist.get_rank() == 0
    task = build_task(config.task.name, config.task.options)
    hf_dir, megatron_dir = broadcast_from_rank0(prepare_model(config, run_dir) if rank0 else None)
    spec = load_hf_config(json.loads((hf_dir / "config.json").read_text()))
    learner = Learner(
        spec, config.parallel, config.learner, total_steps=config.steps,
        init_checkpoint=str(megatron_dir),
    )  # fmt: skip
    resume_from = ckpt.latest_checkpoint(run_dir)
    if resume_from is not None:
        learner.load(str(resume_from / "learner"))
        ckpt.load_rng(resume_from, dist.get_rank())
        if rank0:
            print(f"resumed from {resume_from} (step {learner.steps_done})", flush=True)
    session = RolloutSession(config, task, spec, hf_dir, run_dir, rank0, resume_from)
    try:
        session.start(learner)
        _loop(config, run_dir, learner, session)
    finally:
        session.close()


STOP_FILE = "STOP"
"""Created in the run directory (by a Slurm USR1 trap, or by hand), it ends the run after the
current step with a checkpoint of that step; the same command then resumes from there."""


def _loop(config: RunConfig, run_dir: Path, learner, session: RolloutSession) -> None:
    step = learner.steps_done
    stop_file = run_dir / STOP_FILE
    if dist.get_rank() == 0:
        stop_file.unlink(missing_ok=True)  # a request is for the run that saw it, not a rerun
    if step == 0:
        session.evaluate(step)
    while step < config.steps:
        started = time.monotonic()
        batch = broadcast_from_rank0(session.next_batch(version=step))
        metrics = learner.train_step(batch, pad_id=session.pad_id)
        step += 1
        sync = session.sync(learner, version=step)
        session.log_step(step, batch, metrics, sync, time.monotonic() - started)
        last = step == config.steps
        if last or (config.eval.every_steps and step % config.eval.every_steps == 0):
            session.evaluate(step)
        stop = broadcast_from_rank0(stop_file.exists() if dist.get_rank() == 0 else None)
        if last or stop or step % config.checkpoint.every_steps == 0:
            save_checkpoint(config, run_dir, learner, session, step)
        if stop and not last:
            if dist.get_rank() == 0:
                stop_file.unlink(missing_ok=True)
                print(f"stopped on request at step {step} (checkpoint saved)", flush=True)
            return


def save_checkpoint(config: RunConfig, run_dir: Path, learner, session, step: int) -> None:
    directory = ckpt.step_dir(run_dir, step)
    learner.save(str(directory / "learner"))
    ckpt.save_rng(directory, dist.get_rank())
    if dist.get_rank() == 0:
        ckpt.save_controller_state(directory, session.state_dict(step))
    dist.barrier()
    if dist.get_rank() == 0:
        ckpt.mark_latest(run_dir, directory, config.checkpoint.keep)
