"""The megatron learner: one optimizer step per batch of B trajectories.

    batch (every rank) ─► advantages over the whole batch ─► this DP rank's micro-batches
      ─► megatron forward-backward (its schedules; PP too) with the parallel FlashREINFORCE
         loss ─► finalize grads (DP all-reduce) ─► distributed optimizer step (grad clip)
      ─► LR schedule ─► metrics

Loss scaling: every micro-batch's loss is already its share of the batch loss L (divided by
the global B), so the sum over micro-batches and DP ranks IS L. megatron instead averages: its
schedule divides each micro-batch's loss by the number of micro-batches and multiplies it by CP
(its own losses are means over a CP rank's tokens), and DDP scales gradients by 1 / (DP x CP).
The loss handed to megatron is therefore share * M * DP, which makes the gradient that of L
exactly, for any layout (tests/distributed/test_learner.py checks EP2 with
several micro-batches against one rank with one). MoE auxiliary losses keep megatron's own
scaling (their mean over micro-batches and DP); they are off by default during RL
(LearnerConfig.moe_aux_loss_coeff).

With LearnerConfig.routing_replay, every micro-batch's forward (and its recomputation in the
backward pass) routes tokens to the experts the engine used (learner/routing_replay.py).
"""

from __future__ import annotations

import dataclasses
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

import megatron_fr.parallel  # noqa: F401  (installs the import shim megatron needs on CPU)
from megatron_fr.algo.advantages import compute_advantages
from megatron_fr.buffer.trajectory import Trajectory
from megatron_fr.config.learner import LearnerConfig
from megatron_fr.config.parallel import ParallelConfig
from megatron_fr.learner.micro_batches import (
    MicroBatch,
    MicroBatchPlan,
    micro_batches_for_rank,
    plan_micro_batches,
)
from megatron_fr.learner.nonfinite import nonfinite_cause
from megatron_fr.learner.routing_replay import RoutingReplay
from megatron_fr.models.hf_config import HFModelSpec
from megatron_fr.parallel.cpu_shims import cpu_device_mode
from megatron_fr.parallel.dist_checkpoint import keep_writes_in_process
from megatron_fr.parallel.loss import GlobalBatch, agreed_admission, flash_reinforce_parallel_loss
from megatron_fr.parallel.ppo_loss import ppo_clip_parallel_loss
from megatron_fr.parallel.vocab_parallel import vocab_parallel_log_probs

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def whole_groups(batch: list[Trajectory]) -> torch.Tensor:
    """int64 group index per trajectory, from info["group"] (the G rollouts of one problem
    share it). The buffer hands out whole groups only; a batch with groups of different sizes
    would give group baselines a different estimator, so it is refused."""
    names = [str(t.info.get("group", t.prompt_id)) for t in batch]
    index = {name: i for i, name in enumerate(dict.fromkeys(names))}
    groups = torch.tensor([index[name] for name in names], dtype=torch.int64)
    sizes = torch.bincount(groups)
    if sizes.min() != sizes.max() or sizes.min() < 2:
        raise ValueError(
            f"group estimators need whole groups of equal size >= 2; this batch has group "
            f"sizes {sorted(set(sizes.tolist()))}"
        )
    return groups


def torch_optimizers(optimizer) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside megatron's wrapper (one per chained dense/expert part)."""
    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    return [part.optimizer for part in parts]


def restore_adam_steps(optimizer) -> None:
    """Give every parameter its own Adam step counter, equal to the checkpoint's, after a load.

    Without TE or apex, megatron's distributed optimizer (0.19, distrib_optimizer.py) loads
    torch Adam's per-parameter "step" wrongly in two ways: load_state_dict assigns ONE tensor
    to every parameter's state (``s["step"] = step``), and the dp_reshardable parameter-state
    load then copies the step of the state being loaded INTO (here: the dummy step Learner.load
    takes, 1) over it. So after a resume Adam's bias correction restarts from step 1 (updates
    1.4-2.5x too large), and since torch increments each state's step in place the shared
    tensor then grows by the number of parameters per update, until a later save fails
    megatron's "all steps equal" assertion. The checkpoint's own step survives in the param
    groups (megatron writes it there on save and load), so it is taken from there. With TE or
    apex the fused Adam keeps its step in the param group only and this changes nothing."""
    for inner in torch_optimizers(optimizer):
        for group in inner.param_groups:
            saved = group.get("step")
            for param in group["params"]:
                step = inner.state.get(param, {}).get("step")
                if isinstance(step, torch.Tensor):
                    value = step if saved is None else torch.full_like(step, float(saved))
                    inner.state[param]["step"] = value.detach().clone()


def adam_step_counts(optimizer) -> list[float]:
    """The distinct Adam step counts over all parameters (one value when all agree): the
    per-parameter state's for torch Adam, the param group's for fused (TE/apex) Adam."""
    state_steps, group_steps = set(), set()
    for inner in torch_optimizers(optimizer):
        for state in inner.state.values():
            if "step" in state:
                state_steps.add(float(state["step"]))
        for group in inner.param_groups:
            if group.get("step") is not None and group["params"]:
                group_steps.add(float(group["step"]))
    return sorted(state_steps or group_steps)


def forward_step_on(device: torch.device, score, replay=None, train: bool = True):
    """megatron's forward_step_func for micro-batches built on the CPU: each micro-batch (its
    model inputs, its loss batch, its routing) moves to the model's device before the
    forward, and its logits go to score(micro, logits) -> (loss, reported). With `replay`
    (RoutingReplay), the micro-batch's experts are loaded for the forward and, when
    training, replayed again in the recomputation of its backward."""

    def forward_step(data_iterator, model):
        micro = next(data_iterator).to(device)
        if replay is not None:
            replay.load(micro.routing)
        output = model(
            micro.input_ids, micro.positions, attention_mask=None,
            packed_seq_params=micro.packed_seq_params(),
        )  # fmt: skip
        if replay is not None and train:
            replay.replay_in_backward(output)
        return output, partial(score, micro)

    return forward_step


class Learner:
    """This rank's model stage, its DDP wrapper, the distributed optimizer and LR schedule."""

    def __init__(
        self,
        spec: HFModelSpec,
        parallel: ParallelConfig,
        config: LearnerConfig,
        *,
        total_steps: int,
        init_checkpoint: str | None = None,
        init_hf_dir: str | None = None,
        temperature: float = 1.0,
    ):
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        from megatron_fr.convert.checkpoint import load_megatron_checkpoint
        from megatron_fr.convert.parallel_load import load_hf_into_model
        from megatron_fr.models.gpt import build_gpt_model

        if config.moe_aux_loss_coeff is not None:
            spec = dataclasses.replace(spec, router_aux_loss_coef=config.moe_aux_loss_coeff)
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        self.spec, self.parallel, self.config = spec, parallel, config
        self.pack_sequences = config.pack_sequences
        """Several trajectories per micro-batch row (learner/micro_batches.py), or one each."""
        self.temperature = temperature
        """The rollouts' sampling temperature: the loss's log-probs are those of
        log softmax(logits / temperature), the distribution the engines sampled from and
        report log-probs of (SGLang's sampler and the CPU engine alike)."""
        dtype = DTYPES[config.params_dtype]
        with cpu_device_mode():
            start = init_checkpoint or init_hf_dir
            self.module = build_gpt_model(spec, parallel, params_dtype=dtype, initialize=not start,
                                          routing_replay=config.routing_replay)  # fmt: skip
            if init_checkpoint is not None:
                load_megatron_checkpoint(self.module, init_checkpoint)
            elif init_hf_dir is not None:  # every rank reads only its own shards
                load_hf_into_model(self.module, init_hf_dir, spec, progress=False)
            ddp_config = DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=True
            )
            self.model = DistributedDataParallel(self.module.config, ddp_config, self.module)
            self.optimizer = get_megatron_optimizer(
                OptimizerConfig(
                    optimizer="adam",
                    lr=config.lr,
                    min_lr=config.min_lr,
                    weight_decay=config.weight_decay,
                    adam_beta1=config.adam_beta1,
                    adam_beta2=config.adam_beta2,
                    adam_eps=config.adam_eps,
                    clip_grad=config.clip_grad,
                    bf16=dtype == torch.bfloat16,
                    params_dtype=dtype,
                    use_distributed_optimizer=True,
                ),
                [self.model],
            )
        self.scheduler = OptimizerParamScheduler(
            self.optimizer,
            init_lr=0.0 if config.lr_warmup_steps else config.lr,
            max_lr=config.lr,
            min_lr=config.min_lr,
            lr_warmup_steps=config.lr_warmup_steps,
            lr_decay_steps=max(total_steps, config.lr_warmup_steps + 1),
            lr_decay_style=config.lr_decay_style,
            start_wd=config.weight_decay,
            end_wd=config.weight_decay,
            wd_incr_steps=max(total_steps, 1),
            wd_incr_style="constant",
        )
        self.module.config.finalize_model_grads_func = finalize_model_grads
        self.module.config.no_sync_func = self.model.no_sync
        self.routing_replay = RoutingReplay(self.module, spec) if config.routing_replay else None
        self.steps_done = 0

    @property
    def device(self) -> torch.device:
        """Where this rank's model lives: its inputs go there, and so do the tensors its
        metrics reduce (NCCL reduces device tensors only)."""
        return next(self.module.parameters()).device

    def _global_batch(self, batch: list[Trajectory]) -> GlobalBatch:
        rewards = torch.tensor([t.reward for t in batch], dtype=torch.float64)
        failures = rewards <= 0 if self.config.flash_reinforce.negative_token_fraction < 1 else None
        counts = torch.tensor([t.num_policy_tokens for t in batch], dtype=torch.int64)
        if self.config.estimator == "flash_reinforce":
            advantages = compute_advantages("flash_reinforce", rewards)
        else:
            advantages = compute_advantages(self.config.estimator, rewards, whole_groups(batch))
        # A trajectory left out of the loss (a truncated response under `truncated: mask`)
        # keeps its place in B and in the baseline, with advantage 0: no gradient.
        masked = torch.tensor([bool(t.info.get("loss_masked")) for t in batch])
        advantages = advantages.masked_fill(masked, 0.0)
        return GlobalBatch(advantages=advantages.float(), failures=failures, token_counts=counts)

    def _loss(self, scale: float, global_batch: GlobalBatch, micro: MicroBatch, logits):
        """The configured policy loss of one micro-batch, on the distribution the engines
        sampled from: log softmax(logits / T) at the rollout temperature T."""
        from megatron.core import parallel_state as ps

        logits = logits.float() / self.temperature
        global_batch = global_batch.to(logits.device)
        if self.config.policy_loss == "ppo_clip":
            loss, metrics = ppo_clip_parallel_loss(
                logits, micro.loss_batch, global_batch, self.config.ppo_clip,
                tp_group=ps.get_tensor_model_parallel_group(),
                cp_group=ps.get_context_parallel_group(),
            )  # fmt: skip
        else:
            loss, metrics = flash_reinforce_parallel_loss(
                logits, micro.loss_batch, global_batch, self.config.flash_reinforce,
                tp_group=ps.get_tensor_model_parallel_group(),
                cp_group=ps.get_context_parallel_group(),
            )  # fmt: skip
        reported = {"loss": loss.detach(), "admitted": metrics["admitted"]}
        reported["present"] = metrics["present"]
        reported["clipped"] = metrics.get(
            "clip_fraction_tokens", torch.zeros((), device=loss.device)
        )
        kl = metrics.get("sequence_kl")
        reported["sequence_kl"] = kl.detach() if kl is not None else torch.zeros_like(
            metrics["present"], dtype=torch.float64
        )  # fmt: skip
        return loss * scale, reported

    def _micro_batches(
        self, batch: list[Trajectory], pad_id: int, replay: RoutingReplay | None
    ) -> tuple[MicroBatchPlan, list[MicroBatch]]:
        """The step's plan and this rank's micro-batches: trajectories are dealt over the DP
        ranks, and every row is split over the CP ranks (routing with them, for replay)."""
        from megatron.core import parallel_state as ps

        if replay is not None:
            replay.check(batch)
        plan = plan_micro_batches(
            [t.length for t in batch],
            dp_size=ps.get_data_parallel_world_size(),
            token_budget=self.config.micro_batch_tokens,
            pack=self.pack_sequences,
            cp_size=self.parallel.context,
            sequence_parallel_size=self.parallel.tensor if self.parallel.sequence_parallel else 1,
        )
        micros = micro_batches_for_rank(
            batch, plan, dp_rank=ps.get_data_parallel_rank(),
            cp_rank=ps.get_context_parallel_rank(), pad_id=pad_id, routing=replay is not None,
        )  # fmt: skip
        return plan, micros

    def _schedule(
        self, micros: list[MicroBatch], score, forward_only: bool, replay: RoutingReplay | None
    ) -> list:
        """megatron's forward(-backward) schedule over this rank's micro-batches, each
        micro-batch's output passed to score(micro, logits) -> (loss, reported); with
        `replay`, each micro-batch routed as its trajectories were by the engine."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        forward_step = forward_step_on(self.device, score, replay, train=not forward_only)
        rows, width = micros[0].input_ids.shape
        try:
            return get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=iter(micros),
                model=[self.model],
                num_microbatches=len(micros),
                seq_length=width * self.parallel.context,  # megatron divides it by CP
                micro_batch_size=rows,
                forward_only=forward_only,
            )
        finally:
            if replay is not None:
                replay.clear()

    def train_step(self, batch: list[Trajectory], pad_id: int = 0) -> dict:
        """One optimizer step on the whole batch (every rank passes the same batch): scalar
        metrics, plus per trajectory (lists in batch order) advantages, admitted and the
        gate's sequence_kl. metrics["nonfinite"]: None, or "loss" / "gradient" when that was
        not finite and the step was skipped (no weight, optimizer or schedule change)."""
        from megatron.core import parallel_state as ps

        dp_group = ps.get_data_parallel_group(with_context_parallel=True)
        plan, micros = self._micro_batches(batch, pad_id, self.routing_replay)
        global_batch = self._global_batch(batch)
        # megatron multiplies by CP itself (schedules.forward_step_calc_loss): scale by DP only
        score = partial(self._loss, len(micros) * ps.get_data_parallel_world_size(), global_batch)
        with cpu_device_mode():
            self.model.zero_grad_buffer()
            self.optimizer.zero_grad()
            per_micro = self._schedule(micros, score, False, self.routing_replay)
            # Non-finite loss or gradient: the step is skipped whole (learner/nonfinite.py).
            nonfinite = nonfinite_cause(per_micro, self.module)
            if nonfinite is None:
                updated, grad_norm, _ = self.optimizer.step()
            else:
                updated, grad_norm = False, None
        if nonfinite is None:
            self.scheduler.step(increment=1)
        self.steps_done += 1
        metrics = self._metrics(per_micro, dp_group, updated, grad_norm, batch)
        metrics["nonfinite"] = nonfinite
        metrics["advantages"] = global_batch.advantages.tolist()
        metrics["padding_fraction"] = plan.padding_fraction
        return metrics

    def policy_log_probs(
        self,
        batch: list[Trajectory],
        pad_id: int = 0,
        temperature: float | None = None,
        routing_replay: bool | None = None,
    ) -> list[list[float]]:
        """Every trajectory's policy-token log-probs under the current weights (forward only),
        at the rollout temperature unless given: the learner's side of a learner-vs-engine
        comparison. routing_replay=False scores with the learner's own routing even when
        replay is configured (what replay changes); None: as configured. Every rank passes the
        same batch and gets the whole result."""
        from megatron.core import parallel_state as ps

        temperature = temperature or self.temperature
        if routing_replay and self.routing_replay is None:
            raise ValueError("routing_replay=True needs a learner built with routing_replay")
        replay = None if routing_replay is False else self.routing_replay
        scored: dict[int, dict[int, float]] = {}  # trajectory -> position -> log-prob

        def score(micro: MicroBatch, logits):
            log_probs, _ = vocab_parallel_log_probs(
                logits.float() / temperature, micro.loss_batch.target_ids,
                ps.get_tensor_model_parallel_group(),
            )  # fmt: skip
            segments = micro.loss_batch.segment_ids
            policy = micro.loss_batch.action_mask & (segments >= 0)
            for segment, position, value in zip(
                segments[policy].tolist(), micro.loss_batch.positions[policy].tolist(),
                log_probs[policy].tolist(), strict=True,
            ):  # fmt: skip
                scored.setdefault(segment, {})[position] = value
            return logits.sum() * 0, {}

        with cpu_device_mode(), torch.no_grad():
            micros = self._micro_batches(batch, pad_id, replay)[1]
            self._schedule(micros, score, True, replay)
        everyone: list[dict] = [{} for _ in range(dist.get_world_size())]
        # each trajectory lives on one DP rank, its tokens spread over that rank's CP group
        dist.all_gather_object(everyone, scored)
        merged: dict[int, dict[int, float]] = {}
        for part in everyone:
            for index, values in part.items():
                merged.setdefault(index, {}).update(values)
        return [[v for _, v in sorted(merged[index].items())] for index in range(len(batch))]

    def save(self, directory: str) -> None:
        """Model, distributed-optimizer state and LR schedule as one torch_dist checkpoint
        (every rank calls it; megatron writes each rank's shards)."""
        from megatron.core import dist_checkpointing

        Path(directory).mkdir(parents=True, exist_ok=True)
        keep_writes_in_process()
        with cpu_device_mode():
            dist_checkpointing.save(self._sharded_state(), directory)

    def load(self, directory: str) -> None:
        from megatron.core import dist_checkpointing

        from megatron_fr.convert.checkpoint import use_legacy_keys

        with cpu_device_mode(), torch.no_grad():
            # A fresh torch Adam has no per-parameter state (no "step") for the checkpoint to
            # be loaded into; one step on zero gradients creates it (as megatron does for FSDP
            # with _init_optimizer_states_with_dummy_values). Its effect on the weights is
            # overwritten by the load below.
            self.model.zero_grad_buffer()
            self.optimizer.step()
            request = self._sharded_state(loading=True)
            use_legacy_keys(request, Path(directory))  # run checkpoints of older MoE layouts
            loaded = dist_checkpointing.load(request, directory)
            self.module.load_state_dict(loaded["model"], strict=True)
            self.optimizer.load_state_dict(loaded["optimizer"])
            restore_adam_steps(self.optimizer)
        self.scheduler.load_state_dict(loaded["scheduler"])
        self.steps_done = int(loaded["steps_done"])

    def _sharded_state(self, loading: bool = False) -> dict:
        """megatron 0.19's default optimizer format (flattened ranges) is refused by its own
        dist_checkpointing; "dp_reshardable" (what Megatron-LM uses by default) resumes in the
        same TP/PP layout with any DP size."""
        model = self.module.sharded_state_dict()
        metadata = {"distrib_optim_sharding_type": "dp_reshardable"}
        return {
            "model": model,
            "optimizer": self.optimizer.sharded_state_dict(
                model, is_loading=loading, metadata=metadata
            ),
            "scheduler": self.scheduler.state_dict(),
            "steps_done": self.steps_done,
        }

    def _metrics(self, per_micro, dp_group, updated, grad_norm, batch) -> dict:
        from megatron.core import parallel_state as ps

        # [loss, acceptance, clip fraction, mean KL, admitted per trajectory, KL per trajectory]
        device = self.device
        size = len(batch)
        values = torch.zeros(4 + 2 * size, dtype=torch.float64, device=device)
        if ps.is_pipeline_last_stage():
            admitted, present = agreed_admission(per_micro, dp_group)
            sums = torch.stack(
                [
                    torch.stack([m[key].double() for m in per_micro]).sum()
                    for key in ("loss", "clipped")
                ]
            )
            dist.all_reduce(sums, group=dp_group)
            tokens = max(sum(t.num_policy_tokens for t in batch), 1)
            acceptance = admitted.double().sum() / max(int(present.sum()), 1)
            # each trajectory lives in one micro-batch of one DP rank (every rank of its CP
            # group has the whole value): the sum over DP ranks is the batch's
            kl = torch.stack([m["sequence_kl"].double() for m in per_micro]).sum(0)
            dist.all_reduce(kl, group=ps.get_data_parallel_group())
            scalars = torch.stack([sums[0], acceptance, sums[1] / tokens, kl.mean()])
            values = torch.cat([scalars, admitted.double(), kl])
        if self.parallel.pipeline > 1:
            group = ps.get_pipeline_model_parallel_group()
            last = ps.get_pipeline_model_parallel_last_rank()
            dist.broadcast(values, src=last, group=group)
        steps = torch.tensor([min(adam_step_counts(self.optimizer), default=0.0)], device=device)
        top = torch.tensor([max(adam_step_counts(self.optimizer), default=0.0)], device=device)
        dist.all_reduce(steps, op=dist.ReduceOp.MIN)
        dist.all_reduce(top, op=dist.ReduceOp.MAX)
        return {
            "adam_step_min": steps.item(),
            "adam_step_max": top.item(),
            "loss": values[0].item(),
            "acceptance_rate": values[1].item(),
            "clip_fraction": values[2].item(),
            "sequence_kl_mean": values[3].item(),
            "admitted": [bool(a) for a in values[4 : 4 + size]],
            "sequence_kl": values[4 + size :].tolist(),
            "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
            "update_successful": float(bool(updated)),
            "lr": self.optimizer.param_groups[0]["lr"],
            "policy_tokens": float(sum(t.num_policy_tokens for t in batch)),
        }
