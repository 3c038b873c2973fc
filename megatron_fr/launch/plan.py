"""Learner layout planner: is a TP/PP/CP/EP/ETP layout valid for a model and a GPU count, what
does each GPU hold, and does it fit? Pure arithmetic on the HF config (no torch, no megatron),
so launchers can refuse a layout before they allocate a cluster.

    tools/plan_layout.py --model qwen3-30b-a3b --nodes 1 --gpus-per-node 8 --gpu-mem-gb 80 \
        --tp 4 --ep 8 --etp 1

Parameters per GPU (max over ranks, `params_per_gpu`), under megatron's sharding:
  - non-expert weights of a layer: QKV (+ bias) and the output projection, and a dense MLP,
    are split over TP; norms, q/k norms and the MoE router are replicated on every TP rank;
  - expert weights: E/EP experts per rank, each split over ETP;
  - the word embedding (first stage) and the output layer (last stage) are vocab-split over TP
    (no vocabulary padding: the builder requires TP to divide the vocabulary); tied
    embeddings under PP > 1 keep a copy on the last stage too; the final norm is on the last
    stage; each stage holds L/PP layers.

Bytes of model state per GPU, megatron's distributed optimizer with the learner's settings
(learner/trainer.py: grad_reduce_in_fp32=True, use_distributed_optimizer=True). The megatron-core
user guide ("Distributed Optimizer", docs.nvidia.com/megatron-core/developer-guide/latest/
distrib_optimizer.html) gives bytes per parameter for data-parallel size d:
    bf16 parameters, fp32 gradients: 6 + 12/d  (2 weight + 4 main grad + (4 master + 4 m + 4 v)/d)
    fp32 parameters, fp32 gradients: 8 + 8/d   (4 weight + 4 grad + (4 m + 4 v)/d)
with d the group the optimizer state is sharded over: DP x CP for non-expert parameters, the
expert data-parallel size EDP = world / (ETP x EP x PP) for expert parameters.

Activations per GPU, following Korthikanti et al. 2022, "Reducing Activation Recomputation in
Large Transformer Models" (arXiv:2205.05198, Sec. 4): their per-layer s b h (34 + 5 a s / h)
bytes (bf16, MHA, ungated 4h GeLU MLP) counted per token per layer, without the a s^2 terms,
and generalised to GQA, q/k norms and gated (SwiGLU) or routed MLPs:
    attention  3h + 4q + 4kv c + 4a  (+ 2q + 2kv with q/k norms, + 2q with CP > 1)
                              [input 2h, Q 2q, the K and V the attention reads 4kv c (c =
                              CP: the keys are gathered over the CP group, and its first
                              rank reads every key of its sequences), core-attention output
                              2q, the kernel's fp32 log-sum-exp per head 4a (a = heads),
                              dropout mask h; with CP > 1 the output of each zigzag chunk,
                              kept by its kernel beside their concatenation, 2q
                              (models/chunked_attention.py); MHA at CP 1, without the
                              log-sum-exp: q = kv = h, 11h]
    norms      4h                                           [two norm inputs]
    MLP        2h r + 6F + h                                [fc1 input 2h per routed copy,
                              gate|up output 4F, activation output 2F, dropout mask h; their
                              ungated 4h MLP: 2h + 8h + 8h + h = 19h]
  with q = heads x head_dim, kv = kv_heads x head_dim; dense: r = 1, F = intermediate_size;
  MoE: r = top-k x ETP, F = top-k x moe_intermediate_size (balanced routing: a rank's
  experts see as many token copies as it sent, all-gathered over the ETP group by megatron's
  alltoall dispatcher, each on F / ETP of the width), plus per MoE layer (E experts, top-k k)
    router     2h + 4E                                      [gate input; routing scores]
    combine    2hk                                          [expert outputs, kept by the
                              multiplication with the routing probabilities]
  Flash attention never stores the a s^2 softmax tensors (the part Korthikanti's selective
  recompute drops), and on a GPU the torch spec's attention keeps no mask for packed rows or
  CP (each zigzag chunk's causal alignment is applied inside the kernel), so the estimate
  depends on tokens only.
  Sequence parallelism is assumed whenever TP > 1 (megatron requires it for MoE with TP > 1),
  so every term is divided by TP; a GPU holds T / TP tokens of a micro-batch of
  T = LearnerConfig.micro_batch_tokens tokens on each CP rank (the micro-batch holds T x CP,
  split over the CP group). 1F1B: stage s keeps PP - s micro-batches of its L/PP layers in
  flight. What a layer keeps per token, by LearnerConfig.recompute (megatron's own methods):
    none       all of the above
    selective  the attention's terms, the norms' 4h and the MoE block's (dense: MLP block's)
               input 2h, which megatron's checkpoint keeps to re-run the block
    full       the layer's input 2h
  and with recompute, one layer's full working set while it is recomputed.
  Working buffers, on top of the kept activations; the layers' (dispatch, recomputation)
  and the loss path's are alive at different moments of the step, so the larger of the
  two counts (tools/plan_layout.py's figures are checked against a rehearsal of the step,
  launch/rehearsal.py: tests/unit/test_rehearse_cli.py):
    MoE dispatch  2hk (2 + 2 ETP)   [one layer at a time: the permuted token copies, the
                              all-to-all output, its ETP all-gather and the expert-sorted copy
                              are alive together]
    loss path (last stage)  per token: 2h / TP (final-norm input) + 2h (its output gathered
                              over TP, which the chunked loss keeps for its backward); once:
                              its chunk working set, C (1 + e + b) with C the fp32 logits
                              of one chunk (config/learner.py LOSS_CHUNK_BYTES): the fp32
                              logits, turned into softmax and gradient in place, with
                              entropies (e = 1) their shifted copy, for bf16 (b = 1/2) the
                              bf16 product before its fp32 copy; and the output layer's weight
                              gradient as it is summed over chunks, (V / TP) h x 4 in fp32,
                              + 2 for a bf16 weight (one chunk's bf16 part).
                              The logits of the micro-batch are never held whole
                              (models/token_scores.py).
  The optimizer step, after the activations are freed: torch Adam's foreach kernels (a GPU's,
  without TE or apex) hold one fp32 temporary of the rank's optimizer shards, 4 bytes per
  parameter over the shard group; a stage's peak on top of its model state is the larger of
  that and its activations (activation_bytes).
  The weight sync, after the optimizer step (its temporaries freed): each stage's sending
  rank holds the bucket being sent and, with weights.overlap, the next one being built (at
  least the largest HF tensor, which goes alone: weights/sync.py's buckets,
  docs/weight-sync.md), (1 + overlap) x max(bucket, largest tensor); one more peak candidate
  beside the activations and the optimizer step, counted on every stage (its first rank
  sends).

What neither these formulas nor the rehearsal's fake tensors see, added to every stage's peak
as stated terms (`untraced_terms`; printed by describe and the rehearsal, each with its
source):
  CUDA context + cuBLAS workspaces  the context: CUDA_CONTEXT_BYTES, an assumption (NVIDIA
                              publishes no figure; with lazy module loading, torch's default,
                              it is commonly 0.3-0.6 GiB); cuBLAS/cuBLASLt: torch's
                              aten/src/ATen/cuda/CublasHandlePool.cpp allocates a workspace
                              of getChosenWorkspaceSize() per (handle, stream), ":4096:8" =
                              32 MiB on Hopper, and cuBLASLt shares it by default
                              (TORCH_CUBLASLT_UNIFIED_WORKSPACE); two streams (compute and the
                              weight sync's overlap thread)
  NCCL buffers                per communicator the rank is in (groups of more than one rank
                              that a step or the sync uses: `nccl_groups`), per channel one
                              NCCL_BUFFSIZE receive buffer (4 MiB, NCCL's documented default)
                              for each of the Simple and LL128 protocols, 32 channels (NCCL's
                              most, NVLink-class): 256 MiB a group, an assumption until a GPU
                              run measures it
  Allocator fragmentation stays in the `reserve` allowance.

Rows: a micro-batch holds trajectories of at most config/learner.py's longest_row tokens
(micro_batch_tokens x CP, less the CP and SP padding), the learner's own rule; plan_layout
refuses a layout whose micro-batches cannot hold the recipe's longest row.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass
from typing import Any

from megatron_fr.config.learner import LOSS_CHUNK_BYTES, longest_row, micro_batch_tokens_for
from megatron_fr.config.parallel import ParallelConfig
from megatron_fr.models.hf_config import HFModelSpec
from megatron_fr.models.layout import LayoutError, check_model_layout, divisors

GIB = 2**30
DEFAULT_RESERVE_GIB = 4.0
"""Allowance for allocator fragmentation and whatever no stated term counts (the CUDA
context, cuBLAS workspaces and NCCL buffers are `untraced_terms`): a rule of thumb, not a
measurement; pass another with --reserve-gb."""
MIB = 2**20
CUDA_CONTEXT_BYTES = 512 * MIB
"""The CUDA context of one process on one GPU: an assumption (module docstring)."""
CUBLAS_WORKSPACE_BYTES = 32 * MIB
"""torch's cuBLAS workspace per (handle, stream) on Hopper: CublasHandlePool.cpp's
getChosenWorkspaceSize(), ":4096:8" (8 x 4096 KiB); cuBLASLt shares it by default."""
CUBLAS_STREAMS = 2
"""Streams that run GEMMs: the compute stream and the weight sync's overlap thread."""
NCCL_BUFFSIZE = 4 * MIB
"""NCCL_BUFFSIZE's documented default (NCCL's environment variables)."""
NCCL_CHANNELS = 32
"""NCCL's most channels per communicator (NVLink-class links open that many): an assumption."""
NCCL_PROTOCOL_BUFFERS = 2
"""Receive buffers of NCCL_BUFFSIZE per channel: the Simple and LL128 protocols (LL's is
1/16 as big and left out)."""
NCCL_GROUP_BYTES = NCCL_BUFFSIZE * NCCL_PROTOCOL_BUFFERS * NCCL_CHANNELS
DEFAULT_SYNC_BUCKET_BYTES = 512 * MIB
"""config/weights.py's default weights.bucket_mib."""
BYTES_PER_PARAM = {
    # dtype: (weight, gradient, optimizer state before dividing by the shard group)
    "bfloat16": (2, 4, 12),
    "float32": (4, 4, 8),
}
RECOMPUTE = ("none", "selective", "full")
"""LearnerConfig.recompute's settings, least recomputation first."""


@dataclass(frozen=True)
class Term:
    """Memory a GPU holds that neither the planner's formulas nor the rehearsal trace: stated,
    with where its figure comes from."""

    name: str
    bytes: int
    source: str


@dataclass(frozen=True)
class ParamCounts:
    """Parameters one GPU holds, split by how the optimizer shards them."""

    dense: int
    expert: int

    @property
    def total(self) -> int:
        return self.dense + self.expert


@dataclass(frozen=True)
class StagePlan:
    stage: int
    params: ParamCounts
    weight_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: dict[str, int]
    """What the stage holds on top of its model state at its peak, by LearnerConfig.recompute
    setting: its activations and working buffers, or the optimizer step's temporaries when
    larger (module docstring)."""
    kept_bytes: dict[str, int]
    """The part of activation_bytes kept for the backward (the rest: the working buffers and
    the layer being recomputed), by recompute setting."""
    sync_bytes: int = 0
    """The weight sync's buckets on the stage's sending rank, after the optimizer step: a
    peak candidate of activation_bytes (module docstring)."""

    @property
    def state_bytes(self) -> int:
        return self.weight_bytes + self.grad_bytes + self.optimizer_bytes


@dataclass(frozen=True)
class Plan:
    """One layout's figures; the `peak` stage is the one with the most memory."""

    world: int
    parallel: ParallelConfig
    is_moe: bool
    data_parallel: int
    expert_data_parallel: int
    params_total: int
    micro_batch_tokens: int
    longest_row: int
    """The longest trajectory (tokens) a micro-batch holds (config/learner.py)."""
    params_dtype: str
    stages: tuple[StagePlan, ...]
    gpu_mem_bytes: int | None
    reserve_bytes: int
    untraced: tuple[Term, ...] = ()
    """The stated terms added to every stage's peak (untraced_terms)."""

    @property
    def params_per_gpu(self) -> int:
        return max(stage.params.total for stage in self.stages)

    @property
    def untraced_bytes(self) -> int:
        return sum(term.bytes for term in self.untraced)

    def peak_bytes(self, recompute: str) -> int:
        return self.untraced_bytes + max(
            s.state_bytes + s.activation_bytes[recompute] for s in self.stages
        )

    def fits(self, recompute: str) -> bool | None:
        """Whether the layout fits with this LearnerConfig.recompute; None when no GPU memory
        was given."""
        if self.gpu_mem_bytes is None:
            return None
        return self.peak_bytes(recompute) + self.reserve_bytes <= self.gpu_mem_bytes

    def least_recompute(self) -> str | None:
        """The least recomputation with which the layout fits (None: it does not fit)."""
        return next((mode for mode in RECOMPUTE if self.fits(mode) is not False), None)

    def to_dict(self) -> dict:
        """The --json form: integers are parameter counts or bytes; per-setting figures are
        keyed by LearnerConfig.recompute."""
        p = self.parallel
        peak = max(self.stages, key=lambda s: s.state_bytes + s.activation_bytes["none"])
        return dict(
            world=self.world,
            layout=dict(
                tp=p.tensor,
                pp=p.pipeline,
                cp=p.context,
                ep=p.expert,
                etp=p.effective_expert_tensor,
                dp=self.data_parallel,
                edp=self.expert_data_parallel,
                sequence_parallel=p.tensor > 1,
            ),
            params_total=self.params_total,
            params_per_gpu=self.params_per_gpu,
            params_dtype=self.params_dtype,
            micro_batch_tokens=self.micro_batch_tokens,
            longest_row=self.longest_row,
            per_gpu=dict(
                stage=peak.stage,
                dense_params=peak.params.dense,
                expert_params=peak.params.expert,
                weight_bytes=peak.weight_bytes,
                grad_bytes=peak.grad_bytes,
                optimizer_bytes=peak.optimizer_bytes,
                state_bytes=peak.state_bytes,
                activation_bytes=peak.activation_bytes,
            ),
            peak_bytes={mode: self.peak_bytes(mode) for mode in RECOMPUTE},
            gpu_mem_bytes=self.gpu_mem_bytes,
            reserve_bytes=self.reserve_bytes,
            untraced=[asdict(term) for term in self.untraced],
            untraced_bytes=self.untraced_bytes,
            fits={mode: self.fits(mode) for mode in RECOMPUTE},
            stages=[asdict(s) | {"state_bytes": s.state_bytes} for s in self.stages],
        )


def check_layout(spec: HFModelSpec, parallel: ParallelConfig, world: int) -> None:
    """Raise LayoutError with the reason if `parallel` cannot train `spec` on `world` GPUs: the
    world-size rules of ParallelConfig, the model's rules (models/layout.py, the ones model
    build enforces), then megatron's training-time rule for MoE with TP > 1: sequence
    parallelism is required (MoELayer.forward raises it, in training only, at the first
    forward: far too late to find out)."""
    try:
        parallel.validate_world(world)
    except ValueError as error:
        raise LayoutError(str(error)) from None
    check_model_layout(spec, parallel)
    if spec.is_moe and parallel.tensor > 1 and not parallel.sequence_parallel:
        raise LayoutError(
            f"a MoE model at parallel.tensor={parallel.tensor} needs "
            "parallel.sequence_parallel=true (megatron refuses MoE with tensor parallelism and "
            "without sequence parallelism at its first training step)"
        )


def layer_params(spec: HFModelSpec) -> dict[str, int]:
    """Parameters of one decoder layer by how they shard: tp (split over TP), replicated,
    expert (all experts together)."""
    h, q, kv = spec.hidden_size, _q(spec), _kv(spec)
    qkv_out = q + 2 * kv
    tp_split = h * qkv_out + (qkv_out if spec.qkv_bias else 0) + q * h
    replicated = 2 * h + (2 * spec.head_dim if spec.qk_layernorm else 0)
    if spec.is_moe:
        replicated += spec.num_experts * h  # router
        expert = spec.num_experts * 3 * h * spec.moe_intermediate_size
    else:
        tp_split += 3 * h * spec.intermediate_size
        expert = 0
    return dict(tp=tp_split, replicated=replicated, expert=expert)


def total_params(spec: HFModelSpec) -> int:
    per_layer = sum(layer_params(spec).values())
    embeddings = spec.vocab_size * spec.hidden_size * (1 if spec.tie_word_embeddings else 2)
    return spec.num_layers * per_layer + embeddings + spec.hidden_size  # + final norm


def stage_params(spec: HFModelSpec, parallel: ParallelConfig, stage: int) -> ParamCounts:
    tp, pp, ep = parallel.tensor, parallel.pipeline, parallel.expert
    etp = parallel.effective_expert_tensor
    layers = spec.num_layers // pp
    layer = layer_params(spec)
    dense = layers * (layer["tp"] // tp + layer["replicated"])
    expert = layers * layer["expert"] // (ep * etp)
    embedding = spec.vocab_size * spec.hidden_size // tp
    if stage == 0:
        dense += embedding
    if stage == pp - 1:
        dense += spec.hidden_size  # final norm
        if not spec.tie_word_embeddings or pp > 1:
            dense += embedding  # output layer, or the tied copy on the last stage
    return ParamCounts(dense=dense, expert=expert)


def attention_bytes_per_token_layer(spec: HFModelSpec, context: int = 1) -> int:
    """What a layer's attention keeps per token at CP `context` (module docstring)."""
    h, q, kv, heads = spec.hidden_size, _q(spec), _kv(spec), spec.num_attention_heads
    kept = 3 * h + 4 * q + 4 * kv * context + 4 * heads
    chunk_outputs = 2 * q if context > 1 else 0
    return kept + chunk_outputs + (2 * q + 2 * kv if spec.qk_layernorm else 0)


def activation_bytes_per_token_layer(
    spec: HFModelSpec, expert_tensor: int = 1, context: int = 1
) -> int:
    """Bytes one token leaves for the backward in one layer, no recompute (module docstring)."""
    h = spec.hidden_size
    attention, norms = attention_bytes_per_token_layer(spec, context), 4 * h
    if not spec.is_moe:
        return attention + norms + 2 * h + 6 * spec.intermediate_size + h
    k = spec.num_experts_per_tok
    experts = 2 * h * k * expert_tensor + 6 * k * spec.moe_intermediate_size + h
    router = 2 * h + 4 * spec.num_experts
    combine = 2 * h * k
    return attention + norms + experts + router + combine


def kept_bytes_per_token_layer(
    spec: HFModelSpec, expert_tensor: int, recompute: str, context: int = 1
) -> int:
    """What one layer keeps per token for the backward under a recompute setting."""
    h = spec.hidden_size
    if recompute == "full":
        return 2 * h
    if recompute == "selective":
        return attention_bytes_per_token_layer(spec, context) + 4 * h + 2 * h
    return activation_bytes_per_token_layer(spec, expert_tensor, context)


def moe_dispatch_bytes_per_token(spec: HFModelSpec, expert_tensor: int = 1) -> int:
    """The token-dispatch working set of one MoE layer, per token (module docstring)."""
    if not spec.is_moe:
        return 0
    return 2 * spec.hidden_size * spec.num_experts_per_tok * (2 + 2 * expert_tensor)


def loss_path_bytes(
    spec: HFModelSpec, tokens: int, tensor: int, params_dtype: str, entropies: bool
) -> int:
    """The last stage's final norm and chunked loss path for a micro-batch of `tokens` on a
    CP rank, its output layer split over `tensor` ranks (module docstring)."""
    h, bf16 = spec.hidden_size, params_dtype == "bfloat16"
    per_token = tokens * (2 * h // tensor + 2 * h)
    chunk = LOSS_CHUNK_BYTES * (1 + entropies) + (LOSS_CHUNK_BYTES // 2 if bf16 else 0)
    weight_gradient = spec.vocab_size // tensor * h * (6 if bf16 else 4)
    return per_token + chunk + weight_gradient


def nccl_groups(
    parallel: ParallelConfig, world: int, sender: bool = True, moe: bool = True
) -> list[str]:
    """The NCCL communicators of more than one rank a learner rank is in when it trains and
    syncs: the default group (the learner's own reductions), TP (sequence parallelism, the
    vocab-parallel loss), CP (the keys and values gathered), DP x CP (the distributed
    optimizer's reduce-scatter and all-gather of dense gradients and weights), EP (the token
    all-to-all), ETP, expert DP (expert gradients), the model-parallel groups the gradient
    norm is reduced over (TP x PP, and ETP x EP x PP), a pipeline stage's two neighbours
    (point to point) and, on a sending rank, the weight-update group with the engines. A
    dense model (`moe` False) uses no expert group (torch makes a communicator at a group's
    first collective)."""
    tp, pp, cp, ep = parallel.tensor, parallel.pipeline, parallel.context, parallel.expert
    etp = parallel.effective_expert_tensor
    dp = world // (tp * pp * cp)
    edp = world // (etp * ep * pp)
    sizes = {
        "world": world,
        "TP": tp,
        "CP": cp,
        "DPxCP": dp * cp,
        "EP": ep,
        "ETP": etp,
        "EDP": edp,
        "TPxPP": tp * pp,
        "ETPxEPxPP": etp * ep * pp,
    }
    if not moe:
        sizes = {name: size for name, size in sizes.items() if "E" not in name}
    groups = [name for name, size in sizes.items() if size > 1]
    if pp > 1:
        groups += ["PP previous", "PP next"]
    if sender:
        groups.append("weight sync")
    return groups


def untraced_terms(parallel: ParallelConfig, world: int, moe: bool = True) -> tuple[Term, ...]:
    """The stated terms of a rank's memory that nothing traces (module docstring)."""
    groups = nccl_groups(parallel, world, moe=moe)
    return (
        Term(
            "CUDA context + cuBLAS workspaces",
            CUDA_CONTEXT_BYTES + CUBLAS_STREAMS * CUBLAS_WORKSPACE_BYTES,
            f"context {CUDA_CONTEXT_BYTES // MIB} MiB assumed; cuBLAS {CUBLAS_STREAMS} x "
            f"{CUBLAS_WORKSPACE_BYTES // MIB} MiB (torch CublasHandlePool.cpp, Hopper)",
        ),
        Term(
            f"NCCL buffers, {len(groups)} groups",
            len(groups) * NCCL_GROUP_BYTES,
            f"{NCCL_GROUP_BYTES // MIB} MiB a group ({NCCL_CHANNELS} channels x "
            f"{NCCL_PROTOCOL_BUFFERS} x NCCL_BUFFSIZE {NCCL_BUFFSIZE // MIB} MiB): "
            + ", ".join(groups),
        ),
    )


def largest_hf_tensor_bytes(spec: HFModelSpec, params_dtype: str) -> int:
    """The largest tensor the weight sync sends (the embedding or the output layer, or a
    dense MLP's projection), in the parameters' dtype."""
    h = spec.hidden_size
    widest = max(
        spec.vocab_size, spec.intermediate_size or 0, spec.num_attention_heads * spec.head_dim
    )
    return h * widest * BYTES_PER_PARAM[params_dtype][0]


def sync_bytes(spec: HFModelSpec, params_dtype: str, bucket_bytes: int, overlap: bool) -> int:
    """The weight sync's buckets on a sending rank (module docstring)."""
    return (1 + overlap) * max(bucket_bytes, largest_hf_tensor_bytes(spec, params_dtype))


def plan_layout(
    spec: HFModelSpec,
    parallel: ParallelConfig,
    world: int,
    *,
    micro_batch_tokens: int,
    params_dtype: str = "bfloat16",
    gpu_mem_gib: float | None = None,
    reserve_gib: float = DEFAULT_RESERVE_GIB,
    entropies: bool = False,
    row_tokens: int | None = None,
    sync_bucket_bytes: int = DEFAULT_SYNC_BUCKET_BYTES,
    sync_overlap: bool = True,
) -> Plan:
    """The figures of a layout; LayoutError if it is invalid (check_layout) or, given the
    recipe's longest row (`row_tokens`), if its micro-batches cannot hold that row.
    `entropies`: the loss computes token entropies (negative_token_fraction < 1);
    `sync_bucket_bytes`, `sync_overlap`: weights.bucket_mib (in bytes) and weights.overlap."""
    check_layout(spec, parallel, world)
    tp, cp = parallel.tensor, parallel.context
    longest = longest_row(micro_batch_tokens, cp, tp)  # SP whenever TP > 1
    if row_tokens is not None and row_tokens > longest:
        raise LayoutError(
            f"rows of {row_tokens} tokens do not fit a micro-batch: learner.micro_batch_tokens "
            f"{micro_batch_tokens} x parallel.context {cp} holds at most {longest}; at CP{cp} "
            f"the rows need micro_batch_tokens >= {micro_batch_tokens_for(row_tokens, cp, tp)}"
        )
    dp = parallel.data_parallel_size(world)
    edp = world // (parallel.effective_expert_tensor * parallel.pipeline * parallel.expert)
    sync = sync_bytes(spec, params_dtype, sync_bucket_bytes, sync_overlap)
    stages = tuple(
        _stage_plan(
            spec, parallel, stage, micro_batch_tokens, params_dtype, entropies, dp, edp, sync
        )
        for stage in range(parallel.pipeline)
    )
    return Plan(
        world=world,
        parallel=parallel,
        is_moe=spec.is_moe,
        data_parallel=dp,
        expert_data_parallel=edp,
        params_total=total_params(spec),
        micro_batch_tokens=micro_batch_tokens,
        longest_row=longest,
        params_dtype=params_dtype,
        stages=stages,
        gpu_mem_bytes=None if gpu_mem_gib is None else int(gpu_mem_gib * GIB),
        reserve_bytes=int(reserve_gib * GIB),
        untraced=untraced_terms(parallel, world, spec.is_moe),
    )


def _stage_plan(
    spec: HFModelSpec,
    parallel: ParallelConfig,
    stage: int,
    micro_batch_tokens: int,
    params_dtype: str,
    entropies: bool,
    dp: int,
    edp: int,
    sync: int = 0,
) -> StagePlan:
    """One pipeline stage's state and activations by recompute setting (module docstring)."""
    weight_b, grad_b, optim_b = BYTES_PER_PARAM[params_dtype]
    tp, pp, etp = parallel.tensor, parallel.pipeline, parallel.effective_expert_tensor
    tokens = micro_batch_tokens / tp  # this GPU's share of a micro-batch
    params = stage_params(spec, parallel, stage)
    layers, in_flight = spec.num_layers // pp, pp - stage
    cp = parallel.context
    layer = tokens * activation_bytes_per_token_layer(spec, etp, cp)  # one layer's working set
    dispatch = tokens * moe_dispatch_bytes_per_token(spec, etp)
    loss = 0
    if stage == pp - 1:
        loss = loss_path_bytes(spec, micro_batch_tokens, tp, params_dtype, entropies)
    activations: dict[str, int] = {}
    kept: dict[str, int] = {}
    for mode in RECOMPUTE:
        kept[mode] = int(
            in_flight * layers * tokens * kept_bytes_per_token_layer(spec, etp, mode, cp)
        )
        recomputing = 0 if mode == "none" else layer  # the layer being re-run
        # the loss path's working set (the output layer's backward) and a layer's (its
        # dispatch, its recomputation) are alive at different moments of the step
        activations[mode] = max(
            int(kept[mode] + max(loss, recomputing + dispatch)),
            optimizer_step_bytes(params, parallel.context * dp, edp),
            sync,
        )
    return StagePlan(
        stage=stage,
        params=params,
        weight_bytes=params.total * weight_b,
        grad_bytes=params.total * grad_b,
        optimizer_bytes=params.dense * optim_b // (dp * parallel.context)
        + params.expert * optim_b // edp,
        activation_bytes=activations,
        kept_bytes=kept,
        sync_bytes=sync,
    )


def optimizer_step_bytes(params: ParamCounts, dense_group: int, expert_group: int) -> int:
    """The optimizer step's working memory (module docstring): torch Adam's foreach kernels
    (a GPU's) hold one float32 temporary of this rank's optimizer shards."""
    return 4 * (params.dense // dense_group + params.expert // expert_group)


def enumerate_layouts(
    spec: HFModelSpec, world: int, gpus_per_node: int, **plan_kwargs: Any
) -> list[Plan]:
    """Every valid layout on `world` GPUs that fits with some recompute setting (all of them
    when no memory is given), best first: least recomputation needed, then least model
    parallelism (TP x CP x PP: more data parallelism, fewer collectives), then least memory.
    TP stays within a node (its all-reduces need NVLink), ETP is 1 or TP (megatron's usual
    choices); with row_tokens, only layouts whose micro-batches hold the rows."""
    tps = [t for t in divisors(world) if t <= max(gpus_per_node, 1)]
    eps = divisors(world) if spec.is_moe else [1]
    plans = []
    for tp, cp, pp, ep in itertools.product(tps, divisors(world), divisors(world), eps):
        for etp in sorted({1, tp}) if spec.is_moe else [None]:
            parallel = ParallelConfig(
                tensor=tp,
                pipeline=pp,
                context=cp,
                expert=ep,
                expert_tensor=etp,
                sequence_parallel=tp > 1,
            )
            try:
                plan = plan_layout(spec, parallel, world, **plan_kwargs)
            except LayoutError:
                continue
            if plan.least_recompute() is not None:
                plans.append(plan)

    def order(plan: Plan) -> tuple:
        p = plan.parallel
        return (
            RECOMPUTE.index(plan.least_recompute()),
            p.tensor * p.context * p.pipeline,
            p.pipeline,
            plan.peak_bytes("none"),
        )

    return sorted(plans, key=order)


def describe(plan: Plan) -> str:
    """Human-readable lines for one layout."""
    p, d = plan.parallel, plan.to_dict()
    per = d["per_gpu"]
    layout, extra = f"TP{p.tensor} PP{p.pipeline} CP{p.context}", f"DP{plan.data_parallel}"
    if plan.is_moe:
        layout += f" EP{p.expert} ETP{p.effective_expert_tensor}"
        extra += f", EDP{plan.expert_data_parallel}"
    layout += f" ({extra}{', SP' if p.tensor > 1 else ''}) on {plan.world} ranks"
    moe = f" = dense {per['dense_params']:,} + expert {per['expert_params']:,}"
    by_mode = ", ".join(f"{_gib(d['peak_bytes'][m])} {m}" for m in RECOMPUTE)
    lines = [
        layout,
        f"  params total {plan.params_total:,}; per GPU (max over ranks) {plan.params_per_gpu:,}"
        + (moe if plan.is_moe else ""),
        f"  {plan.params_dtype} weights {_gib(per['weight_bytes'])}, grads (fp32)"
        f" {_gib(per['grad_bytes'])}, distributed optimizer {_gib(per['optimizer_bytes'])}"
        f" -> model state {_gib(per['state_bytes'])}",
        f"  micro-batches of {plan.micro_batch_tokens:,} tokens per GPU hold rows of up to"
        f" {plan.longest_row:,} tokens",
        f"  peak by learner.recompute: {by_mode}; reserve {_gib(plan.reserve_bytes)}",
        *(f"  not traced, added: {t.name} {_gib(t.bytes)} ({t.source})" for t in plan.untraced),
        f"  weight-sync buckets on the sender {_gib(plan.stages[0].sync_bytes)} (after the"
        " optimizer step: a peak candidate, not added on top)",
    ]
    if plan.gpu_mem_bytes is not None:
        verdicts = ", ".join(f"{m} {'yes' if d['fits'][m] else 'no'}" for m in RECOMPUTE)
        lines.append(f"  fits {_gib(plan.gpu_mem_bytes)}: {verdicts}")
    return "\n".join(lines)


def _q(spec: HFModelSpec) -> int:
    return spec.num_attention_heads * spec.head_dim


def _kv(spec: HFModelSpec) -> int:
    return spec.num_key_value_heads * spec.head_dim


def _gib(value: int) -> str:
    if value < GIB:
        return f"{value / 2**20:.1f} MiB"
    return f"{value / GIB:.2f} GiB"
