"""A megatron MoE GPT trains the same under TP2+SP, EP2 and TP2xEP2 as under TP1, on CPU.

One spawn of 4 gloo ranks; inside it, every rank re-initialises megatron's parallel_state for
each layout (megatron_fr.parallel.state.initialize), so the CPU shims are exercised for model
build, forward, backward, the alltoall MoE dispatcher and the PP=1 pipeline schedule.

The reference is the TP1 model, built on every rank from megatron's own initialisation after
model_parallel_cuda_manual_seed, and its gradients on one micro-batch. Each other layout loads
the reference weights sliced into its shards (each parameter's partition_dim/partition_stride;
local expert j on EP rank r is global expert r * num_local + j) and must reproduce the loss
and, shard by shard, every gradient. All ranks see the same micro-batches, so data-parallel
replicas agree without a gradient all-reduce; two sums megatron's DDP/finalize_model_grads
would otherwise do are done here by hand (see expected_grad and reduce_sequence_parallel).

    .venv/bin/python -m pytest tests/distributed/test_megatron_cpu.py -q
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from megatron_fr.config import ParallelConfig
from megatron_fr.convert.shard import global_name, load_full_state, shard_tensor
from megatron_fr.parallel.spawn import run_on_ranks

SEED, VOCAB, SEQ, MICRO_BATCH, NUM_MICRO_BATCHES, NUM_EXPERTS = 1234, 128, 16, 2, 3, 4
LAYOUTS = {
    "tp2_sp": ParallelConfig(tensor=2, sequence_parallel=True),
    "ep2": ParallelConfig(expert=2),
    "tp2_ep2_sp": ParallelConfig(tensor=2, expert=2, sequence_parallel=True),
}
SCHEDULE_LAYOUT = "tp2_sp"
LOSS_TOLERANCE, GRAD_TOLERANCE = 1e-5, 1e-5


def build_model(layout: ParallelConfig):
    """Qwen3-MoE-like 2-layer GPT on megatron's local spec (no TE, no apex)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(
        num_layers=2,
        hidden_size=64,
        ffn_hidden_size=128,
        num_attention_heads=4,
        num_query_groups=2,
        normalization="RMSNorm",
        qk_layernorm=True,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        num_moe_experts=NUM_EXPERTS,
        moe_router_topk=2,
        moe_ffn_hidden_size=64,
        moe_token_dispatcher_type="alltoall",
        moe_aux_loss_coeff=1e-2,
        tensor_model_parallel_size=layout.tensor,
        expert_model_parallel_size=layout.expert,
        expert_tensor_parallel_size=layout.effective_expert_tensor,
        sequence_parallel=layout.sequence_parallel,
        params_dtype=torch.float32,
    )
    spec = get_gpt_layer_local_spec(
        num_experts=NUM_EXPERTS, moe_grouped_gemm=False, qk_layernorm=True
    )
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        position_embedding_type="rope",
    )


def micro_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(tokens, labels) pairs, identical on every rank."""
    gen = torch.Generator().manual_seed(SEED)
    shape = (MICRO_BATCH, SEQ)
    return [
        (
            torch.randint(0, VOCAB, shape, generator=gen),
            torch.randint(0, VOCAB, shape, generator=gen),
        )
        for _ in range(NUM_MICRO_BATCHES)
    ]


def lm_loss(model, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(SEQ).expand_as(tokens)
    return model(tokens, positions, attention_mask=None, labels=labels).mean()


def plain_step(model, batch: tuple[torch.Tensor, torch.Tensor]) -> float:
    """One forward+backward outside megatron's schedule.

    MoEAuxLossAutoScaler keeps the aux-loss gradient scale in a class attribute: the schedule
    copies 1/num_microbatches into it (shape [1]), and a plain backward reuses whatever is
    there, or creates a 0-d 1.0 that the schedule's copy then fails on. So a plain step sets
    it to 1, shaped [1], itself."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    MoEAuxLossAutoScaler.set_loss_scale(torch.ones(1))
    model.zero_grad()
    loss = lm_loss(model, *batch)
    loss.backward()
    return loss.item()


def schedule_step(model, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[float]:
    """All micro-batches through megatron's get_forward_backward_func() (PP=1)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward_step(data_iterator, model):
        tokens, labels = next(data_iterator)
        positions = torch.arange(SEQ).expand_as(tokens)
        per_token = model(tokens, positions, attention_mask=None, labels=labels)

        def loss_func(output: torch.Tensor):
            loss = output.mean()  # the schedule divides this in place by the micro-batch count
            return loss, {"lm loss": loss.detach().clone()}

        return per_token, loss_func

    model.zero_grad()
    reported = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(batches),
        model=[model],
        num_microbatches=len(batches),
        seq_length=SEQ,
        micro_batch_size=MICRO_BATCH,
        forward_only=False,
    )
    return [row["lm loss"].item() for row in reported]


def grads(model) -> dict[str, torch.Tensor]:
    return {name: param.grad.detach().clone() for name, param in model.named_parameters()}


def load_reference(model, reference: dict[str, torch.Tensor]) -> None:
    load_full_state(model, reference, NUM_EXPERTS)


def reduce_sequence_parallel(model) -> None:
    """Sum over TP the gradients of parameters tagged ``sequence_parallel`` (norms, router):
    each TP rank saw only its slice of the sequence (as finalize_model_grads does)."""
    from megatron.core import parallel_state as ps

    if ps.get_tensor_model_parallel_world_size() == 1:
        return
    for param in model.parameters():
        if getattr(param, "sequence_parallel", False):
            dist.all_reduce(param.grad, group=ps.get_tensor_model_parallel_group())


def expected_grad(name: str, param, reference_grads: dict[str, torch.Tensor]) -> torch.Tensor:
    """The reference gradient this rank should hold for `param`.

    An expert receives the tokens of every data-parallel replica in its EP group. All replicas
    see the same batch here, so its gradient is the reference times DP / expert-DP (the factor
    megatron's DDP divides expert gradients by)."""
    from megatron.core import parallel_state as ps

    expected = shard_tensor(reference_grads[global_name(name, NUM_EXPERTS)], name, param)
    if ".experts." in name:
        replicas = ps.get_data_parallel_world_size() // ps.get_expert_data_parallel_world_size()
        expected = expected * replicas
    return expected


def compare(model, loss, reference_loss, reference_grads) -> dict:
    """Loss difference, the largest gradient difference over every parameter shard, whether
    all gradients are finite, which are all zero, and a few gradient norms."""
    reduce_sequence_parallel(model)
    worst, finite, zero = 0.0, True, []
    for name, param in model.named_parameters():
        grad = param.grad
        finite &= bool(torch.isfinite(grad).all())
        if not grad.abs().sum() > 0:
            zero.append(name)
        diff = (grad - expected_grad(name, param, reference_grads)).abs().max().item()
        worst = max(worst, diff)
    loss_error = (torch.tensor(loss) - torch.tensor(reference_loss)).abs().max().item()
    return dict(
        loss=loss,
        loss_error=loss_error,
        grad_error=worst,
        finite=finite,
        zero_grads=zero,
        norms=grad_norms(model),
    )


def grad_norms(model) -> dict[str, float]:
    """A few local gradient norms (after the sequence-parallel sum), to show they are real."""
    picks = ("embedding.word_embeddings.weight", "mlp.router.weight", "local_experts.0.linear_fc1")
    return {
        name: param.grad.norm().item()
        for name, param in model.named_parameters()
        if any(pick in name for pick in picks)
    }


def run_reference(batches) -> tuple[dict, dict]:
    """TP1 (all ranks data-parallel): weights, plain-step and schedule results to match."""
    from megatron_fr.parallel import state

    state.initialize(ParallelConfig(), seed=SEED)
    model = build_model(ParallelConfig())
    ref = dict(weights={name: p.detach().clone() for name, p in model.named_parameters()})
    ref.update(loss=plain_step(model, batches[0]), grads=grads(model))
    row = compare(model, ref["loss"], ref["loss"], ref["grads"])
    ref.update(schedule_losses=schedule_step(model, batches), schedule_grads=grads(model))
    return ref, row


def run_layout(layout: ParallelConfig, ref: dict, batches, with_schedule: bool) -> dict:
    """The reference weights under `layout`: one plain step, then optionally the schedule."""
    from megatron_fr.parallel import state

    state.initialize(layout, seed=SEED)
    model = build_model(layout)
    load_reference(model, ref["weights"])
    rows = dict(plain=compare(model, plain_step(model, batches[0]), ref["loss"], ref["grads"]))
    if with_schedule:
        losses = schedule_step(model, batches)
        rows["schedule"] = compare(model, losses, ref["schedule_losses"], ref["schedule_grads"])
    return rows


def train_layouts(rank: int, world_size: int) -> dict[str, dict]:
    batches = micro_batches()
    ref, reference_row = run_reference(batches)
    results = dict(reference=reference_row)
    for key, layout in LAYOUTS.items():
        rows = run_layout(layout, ref, batches, with_schedule=key == SCHEDULE_LAYOUT)
        results[key] = rows["plain"]
        if "schedule" in rows:
            results[f"{key}_schedule"] = rows["schedule"]
    return results


@pytest.mark.distributed
def test_moe_gpt_matches_tp1_under_tp2_sp_ep2_and_the_schedule():
    per_rank = run_on_ranks(train_layouts, 4, timeout_s=300)
    reference_loss = per_rank[0]["reference"]["loss"]
    assert abs(reference_loss - math.log(VOCAB)) < 0.5  # an untrained model: near uniform
    for rank, results in enumerate(per_rank):
        assert results["reference"]["loss"] == reference_loss  # same init on every rank
        schedule_losses = results[f"{SCHEDULE_LAYOUT}_schedule"]["loss"]
        assert len(schedule_losses) == NUM_MICRO_BATCHES
        assert abs(schedule_losses[0] - reference_loss) <= LOSS_TOLERANCE  # same micro-batch
        for key, row in results.items():
            where = f"rank {rank}, {key}: {row}"
            assert row["loss_error"] <= LOSS_TOLERANCE, where
            assert row["grad_error"] <= GRAD_TOLERANCE, where
            assert row["finite"], where
            assert not row["zero_grads"], where
            assert row["norms"] and all(norm > 0 for norm in row["norms"].values()), where
