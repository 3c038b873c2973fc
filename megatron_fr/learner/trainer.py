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
backward pass, with LearnerConfig.recompute) routes tokens to the experts the engine used
(learner/routing_replay.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from megatron_fr.buffer.trajectory import Trajectory, validate_trajectory
from megatron_fr.config.learner import LearnerConfig
from megatron_fr.config.parallel import ParallelConfig
from megatron_fr.learner.micro_batches import (
    MicroBatch,
    TokenRow,
    micro_batches_for_rank,
)
from megatron_fr.learner.nonfinite import nonfinite_cause
from megatron_fr.learner.policy_loss import policy_loss
from megatron_fr.learner.routing_replay import RoutingReplay
from megatron_fr.learner.step_metrics import Reduced, StepMetrics
from megatron_fr.learner.step_plan import StepPlan, plan_step
from megatron_fr.models.gpt import resolve_layer_spec
from megatron_fr.models.hf_config import HFModelSpec
from megatron_fr.models.token_scores import TargetScores
from megatron_fr.parallel.dist_checkpoint import keep_writes_in_process
from megatron_fr.parallel.loss import GlobalBatch, agreed_admission
from megatron_fr.parallel.state import process_groups

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.optimizer import MegatronOptimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.process_groups_config import ProcessGroupCollection

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

Reported = dict[str, torch.Tensor]
"""One micro-batch's reported values (its loss, admitted, present, clipped, sequence_kl)."""
ScoreFn = Callable[[MicroBatch, torch.Tensor], tuple[torch.Tensor, Reported]]
"""score(micro, scores) -> (loss, reported): a micro-batch's loss from the model's scores."""
ForwardStep = Callable[
    [Iterator[MicroBatch], torch.nn.Module],
    tuple[torch.Tensor, Callable[[torch.Tensor], tuple[torch.Tensor, Reported]]],
]
"""megatron's forward_step_func: (data iterator, model) -> (output, loss function)."""


def torch_optimizers(optimizer: MegatronOptimizer) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside megatron's wrapper (one per chained dense/expert part)."""
    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    return [part.optimizer for part in parts]


def restore_adam_steps(optimizer: MegatronOptimizer) -> None:
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


def adam_step_counts(optimizer: MegatronOptimizer) -> list[float]:
    """The distinct Adam step counts over all parameters (one value when all agree): the
    per-parameter state's for torch Adam, the param group's for fused (TE/apex) Adam."""
    state_steps: set[float] = set()
    group_steps: set[float] = set()
    for inner in torch_optimizers(optimizer):
        for state in inner.state.values():
            if "step" in state:
                state_steps.add(float(state["step"]))
        for group in inner.param_groups:
            if group.get("step") is not None and group["params"]:
                group_steps.add(float(group["step"]))
    return sorted(state_steps or group_steps)


def forward_step_on(
    device: torch.device,
    score: ScoreFn,
    scores: TargetScores,
    replay: RoutingReplay | None = None,
    train: bool = True,
) -> ForwardStep:
    """megatron's forward_step_func for micro-batches built on the CPU: each micro-batch (its
    model inputs, its loss batch, its routing) moves to the model's device before the
    forward; the model (its last stage) returns the targets' log-probs and entropies as
    `scores` asks for them (models/token_scores.py: no logits tensor of the micro-batch), and
    they go to score(micro, scores) -> (loss, reported). With `replay` (RoutingReplay), the
    micro-batch's experts are loaded for the forward and, when training, replayed again in
    the recomputation of its backward."""

    def forward_step(
        data_iterator: Iterator[MicroBatch], model: torch.nn.Module
    ) -> tuple[torch.Tensor, Callable[[torch.Tensor], tuple[torch.Tensor, Reported]]]:
        micro = next(data_iterator).to(device)
        if replay is not None:
            assert micro.routing is not None  # built with routing when replaying
            replay.load(micro.routing)
        output = model(
            micro.input_ids,
            micro.positions,
            attention_mask=None,
            packed_seq_params=micro.packed_seq_params(),
            output_processor=dataclasses.replace(
                scores, targets=micro.loss_batch.target_ids, ids=micro.loss_batch.topk_ids
            ),
        )
        if replay is not None and train:
            replay.replay_in_backward(output)
        return output, partial(score, micro)

    return forward_step


class Learner:
    """This rank's model stage, its DDP wrapper, the distributed optimizer and LR schedule.

    Every process group it uses, and hands to megatron's model, DDP, optimizer, gradient
    finalisation and schedules, comes from `groups` (megatron's ProcessGroupCollection;
    parallel/state.process_groups() when not given): nothing in the learner or its loss reads
    parallel_state's globals."""

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
        groups: ProcessGroupCollection | None = None,
        spec_kind: str | None = None,
    ):
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )

        if config.moe_aux_loss_coeff is not None:
            spec = dataclasses.replace(spec, router_aux_loss_coef=config.moe_aux_loss_coeff)
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        self.spec, self.parallel, self.config = spec, parallel, config
        self.layer_spec = resolve_layer_spec(spec_kind)
        """model.spec as built: te, torch or local (models/gpt.py)."""
        self.groups = groups or process_groups()
        self.pack_sequences = config.pack_sequences
        """Several trajectories per micro-batch row (learner/micro_batches.py), or one each."""
        self.temperature = temperature
        self.policy_loss = policy_loss(config)
        """The rollouts' sampling temperature: the loss's log-probs are those of
        log softmax(logits / temperature), the distribution the engines sampled from and
        report log-probs of (SGLang's sampler and the CPU engine alike)."""
        self.module = self._build_model(init_checkpoint, init_hf_dir)
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=True
        )
        self.model = DistributedDataParallel(
            self.module.config, ddp_config, self.module, pg_collection=self.groups
        )
        self.optimizer = self._build_optimizer()
        self.scheduler = self._build_scheduler(total_steps)
        self.module.config.finalize_model_grads_func = partial(
            finalize_model_grads, pg_collection=self.groups
        )
        self.module.config.no_sync_func = self.model.no_sync
        self.routing_replay = (
            RoutingReplay(self.module, spec, self.groups.tp) if config.routing_replay else None
        )
        self.steps_done = 0

    def _build_model(self, init_checkpoint: str | None, init_hf_dir: str | None) -> GPTModel:
        """This rank's model stage, with the checkpoint's or the HF directory's weights."""
        from megatron_fr.convert.checkpoint import load_megatron_checkpoint
        from megatron_fr.convert.parallel_load import load_hf_into_model
        from megatron_fr.models.gpt import build_gpt_model

        start = init_checkpoint or init_hf_dir
        module = build_gpt_model(
            self.spec,
            self.parallel,
            params_dtype=DTYPES[self.config.params_dtype],
            initialize=not start,
            routing_replay=self.config.routing_replay,
            recompute=self.config.recompute,
            pg_collection=self.groups,
            spec_kind=self.layer_spec,
        )
        if init_checkpoint is not None:
            load_megatron_checkpoint(module, init_checkpoint)
        elif init_hf_dir is not None:  # every rank reads only its own shards
            load_hf_into_model(module, init_hf_dir, self.spec, progress=False, groups=self.groups)
        return module

    def _build_optimizer(self) -> MegatronOptimizer:
        """megatron's distributed Adam(W) over the DDP model (a chained dense/expert one)."""
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        config, dtype = self.config, DTYPES[self.config.params_dtype]
        settings = OptimizerConfig(
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
        )
        # megatron takes explicit groups only without its extra gloo groups (which it would
        # otherwise read from parallel_state to gather optimizer state for checkpoints).
        return get_megatron_optimizer(
            settings, [self.model], use_gloo_process_groups=False, pg_collection=self.groups
        )

    def _build_scheduler(self, total_steps: int) -> OptimizerParamScheduler:
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        config = self.config
        return OptimizerParamScheduler(
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

    @property
    def device(self) -> torch.device:
        """Where this rank's model lives: its inputs go there, and so do the tensors its
        metrics reduce (NCCL reduces device tensors only)."""
        return next(self.module.parameters()).device

    def _loss(
        self, scale: float, global_batch: GlobalBatch, micro: MicroBatch, scores: torch.Tensor
    ) -> tuple[torch.Tensor, Reported]:
        """The configured policy loss of one micro-batch from the model's scores of its target
        tokens ([log-probs; entropies; the top-K gate's log-probs of the engine's top-K ids],
        on the distribution the engines sampled from: log softmax(logits / T) at the rollout
        temperature T)."""
        loss_of = self.policy_loss
        log_probs, entropies = scores[0], scores[1] if loss_of.needs_entropy else None
        topk = scores[2:].permute(1, 2, 0) if scores.shape[0] > 2 else None
        global_batch = global_batch.to(log_probs.device)
        loss, metrics = loss_of(
            log_probs, entropies, micro.loss_batch, global_batch, self.groups.cp, topk
        )
        reported = {"loss": loss.detach(), "admitted": metrics["admitted"]}
        reported["present"] = metrics["present"]
        reported["retained"] = metrics["retained_per_trajectory"]
        reported["clipped"] = metrics.get("clipped_tokens", torch.zeros((), device=loss.device))
        kl = metrics.get("sequence_kl")
        reported["sequence_kl"] = (
            kl.detach()
            if kl is not None
            else torch.zeros_like(metrics["present"], dtype=torch.float64)
        )
        return loss * scale, reported

    def plan(self, batch: list[Trajectory], replayed: bool = True) -> StepPlan:
        """The step plan of a whole batch (every rank computes the same one), its trajectories
        validated and, when they are replayed (routing replay on and `replayed`), checked for
        the model's routed experts."""
        for trajectory in batch:
            validate_trajectory(trajectory)
        if self.routing_replay is not None and replayed:
            self.routing_replay.check(batch)
        return plan_step(batch, self.config, self.parallel, self.groups.dp.size())

    def _micro_batches(
        self,
        step: StepPlan,
        rows: Mapping[int, TokenRow] | Sequence[TokenRow],
        pad_id: int,
        replay: RoutingReplay | None,
    ) -> list[MicroBatch]:
        """This rank's micro-batches: its DP share of the plan, every row split over the CP
        ranks (with this stage's routing, for replay)."""
        return micro_batches_for_rank(
            rows,
            step.plan,
            dp_rank=self.groups.dp.rank(),
            cp_rank=self.groups.cp.rank(),
            pad_id=pad_id,
            routing=None if replay is None else replay.stage_layers,
            top_logprobs=self.config.top_logprobs,
        )

    def _schedule(
        self,
        micros: list[MicroBatch],
        score: ScoreFn,
        forward_only: bool,
        replay: RoutingReplay | None,
        temperature: float,
    ) -> list[Reported]:
        """megatron's forward(-backward) schedule over this rank's micro-batches, each
        micro-batch's scores at `temperature` passed to score(micro, scores) -> (loss,
        reported); with `replay`, each micro-batch routed as its trajectories were by the
        engine."""
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

        scores = TargetScores(torch.empty(0), temperature, self.policy_loss.needs_entropy)
        forward_step = forward_step_on(self.device, score, scores, replay, not forward_only)
        rows, width = micros[0].input_ids.shape
        stages = self.groups.pp.size()
        pipeline = (
            {}
            if stages == 1
            else {
                "p2p_communicator": P2PCommunicator(
                    pp_group=self.groups.pp, config=self.module.config
                )
            }
        )
        try:
            return get_forward_backward_func(pp_size=stages)(
                forward_step_func=forward_step,
                data_iterator=iter(micros),
                model=[self.model],
                num_microbatches=len(micros),
                seq_length=width * self.parallel.context,  # megatron divides it by CP
                micro_batch_size=rows,
                forward_only=forward_only,
                pg_collection=self.groups,
                **pipeline,
            )
        finally:
            if replay is not None:
                replay.clear()

    def train_step(self, batch: list[Trajectory], pad_id: int = 0) -> StepMetrics:
        """One optimizer step on the whole batch, every rank passing the same batch (each
        plans it and trains its own share): train_share's metrics."""
        return self.train_share(self.plan(batch), batch, pad_id)

    def train_share(
        self, step: StepPlan, rows: Mapping[int, TokenRow] | Sequence[TokenRow], pad_id: int = 0
    ) -> StepMetrics:
        """One optimizer step of a planned batch, from the trajectories of this rank's DP
        share (`rows`, by batch index: what the run delivers to it, buffer/shards.py):
        scalar metrics, plus per trajectory (lists in batch order) advantages, admitted and
        the gate's sequence_kl. metrics["nonfinite"]: None, or "loss" / "gradient" when that
        was not finite and the step was skipped (no weight, optimizer or schedule change)."""
        per_micro = self.accumulate_gradients(step, rows, pad_id)
        # Non-finite loss or gradient: the step is skipped whole (learner/nonfinite.py).
        nonfinite = nonfinite_cause(per_micro, self.module)
        if nonfinite is None:
            updated, grad_norm, _ = self.optimizer.step()
            self.scheduler.step(increment=1)
        else:
            updated, grad_norm = False, None
        self.steps_done += 1
        return self._metrics(per_micro, updated, grad_norm, step, nonfinite)

    def accumulate_gradients(
        self, step: StepPlan, rows: Mapping[int, TokenRow] | Sequence[TokenRow], pad_id: int = 0
    ) -> list[Reported]:
        """The forward and backward passes of this rank's micro-batches of a planned batch,
        their gradients in the zeroed gradient buffers (no optimizer step): each
        micro-batch's reported values."""
        micros = self._micro_batches(step, rows, pad_id, self.routing_replay)
        # megatron multiplies by CP itself (schedules.forward_step_calc_loss): scale by DP only
        score = partial(self._loss, len(micros) * self.groups.dp.size(), step.global_batch)
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        return self._schedule(micros, score, False, self.routing_replay, self.temperature)

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

        temperature = temperature or self.temperature
        if routing_replay and self.routing_replay is None:
            raise ValueError("routing_replay=True needs a learner built with routing_replay")
        replay = None if routing_replay is False else self.routing_replay
        scored: dict[int, dict[int, float]] = {}  # trajectory -> position -> log-prob

        def score(micro: MicroBatch, scores: torch.Tensor) -> tuple[torch.Tensor, Reported]:
            log_probs = scores[0]
            segments = micro.loss_batch.segment_ids
            policy = micro.loss_batch.action_mask & (segments >= 0)
            for segment, position, value in zip(
                segments[policy].tolist(),
                micro.loss_batch.positions[policy].tolist(),
                log_probs[policy].tolist(),
                strict=True,
            ):
                scored.setdefault(segment, {})[position] = value
            return scores.sum() * 0, {}

        with torch.no_grad():
            plan = self.plan(batch, replayed=replay is not None)
            micros = self._micro_batches(plan, batch, pad_id, replay)
            self._schedule(micros, score, True, replay, temperature)
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
        dist_checkpointing.save(self._sharded_state(), directory)

    def load(self, directory: str) -> None:
        from megatron.core import dist_checkpointing

        from megatron_fr.convert.checkpoint import use_legacy_keys

        self._check_layer_spec(directory)
        with torch.no_grad():
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

    def _check_layer_spec(self, directory: str) -> None:
        """Refuse a run checkpoint of another layer spec: the distributed optimizer's state is
        laid out in its spec's parameter order (model weights alone load in any spec:
        init_checkpoint). A checkpoint from before the spec was recorded was written with the
        default of then: te where transformer-engine imports, else local."""
        from megatron.core.dist_checkpointing.serialization import load_common_state_dict

        from megatron_fr.models.gpt import use_transformer_engine

        saved = load_common_state_dict(directory).get("layer_spec") or (
            "te" if use_transformer_engine() else "local"
        )
        if saved != self.layer_spec:
            raise ValueError(
                f"{directory} was written by a learner with model.spec {saved}, whose optimizer "
                f"state follows that spec's parameter order: resume it with model.spec {saved} "
                f"(this learner is {self.layer_spec}); its model weights alone load in any "
                "spec (a fresh run's init_checkpoint)"
            )

    def _sharded_state(self, loading: bool = False) -> dict:
        """megatron 0.19's default optimizer format (flattened ranges) is refused by its own
        dist_checkpointing; "dp_reshardable" (what Megatron-LM uses by default) resumes in the
        same TP/PP layout with any DP size, and the same layer spec (_check_layer_spec)."""
        model = self.module.sharded_state_dict()
        metadata = {"distrib_optim_sharding_type": "dp_reshardable"}
        return {
            "model": model,
            "optimizer": self.optimizer.sharded_state_dict(
                model, is_loading=loading, metadata=metadata
            ),
            "scheduler": self.scheduler.state_dict(),
            "steps_done": self.steps_done,
            "layer_spec": self.layer_spec,
        }

    def _metrics(
        self,
        per_micro: list[Reported],
        updated: bool,
        grad_norm: float | None,
        step: StepPlan,
        nonfinite: str | None,
    ) -> StepMetrics:
        """The step's figures on every rank: the loss and the gate's, reduced over the DP
        ranks by the last pipeline stage and broadcast to the others (learner/step_metrics.py
        lays them out), and the optimizer's."""
        size = step.size
        values = torch.zeros(Reduced.width(size), dtype=torch.float64, device=self.device)
        pp = self.groups.pp
        if pp.rank() == pp.size() - 1:
            values = self._reduce(per_micro, step)
        if pp.size() > 1:
            dist.broadcast(values, src=dist.get_global_rank(pp, pp.size() - 1), group=pp)
        reduced = Reduced.unpack(values, size)
        device = values.device
        steps = torch.tensor([min(adam_step_counts(self.optimizer), default=0.0)], device=device)
        top = torch.tensor([max(adam_step_counts(self.optimizer), default=0.0)], device=device)
        dist.all_reduce(steps, op=dist.ReduceOp.MIN)
        dist.all_reduce(top, op=dist.ReduceOp.MAX)
        return StepMetrics(
            adam_step_min=steps.item(),
            adam_step_max=top.item(),
            loss=reduced.loss,
            acceptance_rate=reduced.acceptance_rate,
            clip_fraction=reduced.clip_fraction,
            sequence_kl_mean=reduced.sequence_kl_mean,
            admitted=reduced.admitted,
            sequence_kl=reduced.sequence_kl,
            retained_tokens_mean=reduced.retained_tokens_mean,
            retained_tokens=reduced.retained_tokens,
            grad_norm=float(grad_norm) if grad_norm is not None else float("nan"),
            update_successful=float(bool(updated)),
            lr=self.optimizer.param_groups[0]["lr"],
            policy_tokens=float(step.policy_tokens),
            nonfinite=nonfinite,
            advantages=step.global_batch.advantages.tolist(),
            padding_fraction=step.plan.padding_fraction,
            dp_imbalance=step.plan.dp_imbalance,
        )

    def _reduce(self, per_micro: list[Reported], step: StepPlan) -> torch.Tensor:
        """The last stage: the batch's loss, acceptance, clip fraction and KLs over every
        micro-batch and DP rank, as Reduced's tensor."""
        dp_cp = self.groups.dp_cp
        admitted, present = agreed_admission(per_micro, dp_cp)
        sums = torch.stack(
            [torch.stack([m[key].double() for m in per_micro]).sum() for key in ("loss", "clipped")]
        )
        dist.all_reduce(sums, group=dp_cp)
        acceptance = admitted.double().sum() / max(int(present.sum()), 1)
        # each trajectory lives in one micro-batch of one DP rank (every rank of its CP
        # group has the whole value): the sum over DP ranks is the batch's
        kl = torch.stack([m["sequence_kl"].double() for m in per_micro]).sum(0)
        dist.all_reduce(kl, group=self.groups.dp)
        # a trajectory's tokens are split over its CP group's ranks: the sum over DP x CP
        retained = torch.stack([m["retained"].double() for m in per_micro]).sum(0)
        dist.all_reduce(retained, group=dp_cp)
        figures = {"loss": sums[0], "acceptance_rate": acceptance, "admitted": admitted}
        figures |= {"clip_fraction": sums[1] / max(step.policy_tokens, 1)}
        figures |= {"retained_tokens": retained, "retained_tokens_mean": retained.mean()}
        return Reduced.pack(figures | {"sequence_kl_mean": kl.mean(), "sequence_kl": kl})
