"""tools/plan_layout.py and megatron_fr/launch/plan.py: the figures for Qwen3-30B-A3B at
TP4/EP8/PP1 on 8 GPUs against a hand calculation (every recompute setting), refusals with
their reasons (rows that do not fit a micro-batch included), enumeration, the stated terms
nothing traces (CUDA context, cuBLAS, NCCL groups, the sync's buckets) and --recipe."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_fr.config.learner import LOSS_CHUNK_BYTES
from megatron_fr.config.parallel import ParallelConfig
from megatron_fr.launch.plan import LayoutError, loss_path_bytes, plan_layout, total_params
from megatron_fr.models.hf_config import load_hf_config

REPO = Path(__file__).resolve().parents[2]
GIB = 2**30


def plan_cli(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, str(REPO / "tools" / "plan_layout.py"), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=60)


def test_qwen3_30b_a3b_tp4_ep8_pp1_on_8_gpus_matches_a_hand_calculation():
    # Qwen3-30B-A3B (its public config.json, models/presets): 48 layers, hidden 2048, 32 query
    # heads and 4 KV heads of 128, 128 experts of width 768, top-8, vocab 151936, untied.
    h, layers, vocab, head = 2048, 48, 151936, 128
    q, kv, experts, top_k, width = 32 * head, 4 * head, 128, 8, 768
    qkv, proj = h * (q + 2 * kv), q * h  # no attention bias
    norms = 2 * h + 2 * head  # input + pre-MLP RMSNorm, per-head q/k norms
    router = experts * h
    expert_weights = experts * 3 * h * width  # gate, up, down
    embedding = vocab * h
    assert layers * (qkv + proj + norms + router + expert_weights) + 2 * embedding + h == (
        30_532_122_624
    )  # ~30.5 B, as published
    # TP4 splits QKV, proj and both vocab matrices; norms and router are replicated; EP8
    # gives each rank 16 whole experts (ETP1). PP1: one rank holds all 48 layers.
    dense = layers * ((qkv + proj) // 4 + norms + router) + 2 * embedding // 4 + h
    expert = layers * expert_weights // 8
    assert (dense, expert) == (394_868_736, 3_623_878_656)
    # Distributed optimizer, bf16 weights + fp32 grads: 2 + 4 B/param, plus 12 B/param of
    # fp32 master + Adam m, v sharded over DP = 8/4 = 2 (dense) and EDP = 8/8 = 1 (experts).
    weights, grads = 2 * (dense + expert), 4 * (dense + expert)
    optimizer = 12 * dense // 2 + 12 * expert // 1
    # Activations at 16,384 tokens per micro-batch: TP4 + SP leaves 4,096 tokens per GPU.
    # Per token and layer: attention 3h + 4q + 4kv + 4a (the kernel's fp32 log-sum-exp of
    # each of the a = 32 heads) + (2q + 2kv) for q/k norms, norms 4h,
    # experts 2h*k*ETP + 6*k*f + h, router 2h + 4E, combine 2h*k (the expert outputs the
    # probability weighting keeps). Once per GPU: the MoE dispatch working set 2h*k*(2 + 2 ETP);
    # the chunked loss path: per token of the micro-batch 2h/TP (final-norm input) + 2h (its
    # output gathered over TP), once one chunk of fp32 logits (softmax and gradient made in
    # place) + half one for the bf16 product, and the fp32 accumulator + one bf16 part of the
    # output layer's gradient, (V/TP) h (4 + 2).
    tokens, etp = 16384 // 4, 1
    attention = 3 * h + 4 * q + 4 * kv + 4 * 32 + 2 * q + 2 * kv
    expert_acts = 2 * h * top_k * etp + 6 * top_k * width + h
    router_acts, combine_acts = 2 * h + 4 * experts, 2 * h * top_k
    per_layer = tokens * (attention + 4 * h + expert_acts + router_acts + combine_acts)
    dispatch = tokens * 2 * h * top_k * (2 + 2 * etp)
    output = 16384 * (2 * h // 4 + 2 * h) + LOSS_CHUNK_BYTES * 3 // 2 + vocab // 4 * h * 6
    # What a layer keeps: none all of it; selective the attention, the norms' inputs and the
    # MoE block's input (re-run in the backward); full its input. With recompute, one layer's
    # whole working set while it is re-run. The layer's working set (dispatch, recomputation)
    # and the loss path's are alive at different moments: the larger counts.
    kept = {
        "none": per_layer,
        "selective": tokens * (attention + 4 * h + 2 * h),
        "full": tokens * 2 * h,
    }
    # The optimizer step (activations freed): torch Adam's foreach kernels hold one fp32
    # temporary of the rank's optimizer shards; the larger of that and the activations counts.
    adam_step = 4 * (dense // 2 + expert // 1)
    activations = {
        mode: max(
            layers * kept[mode] + max((mode != "none") * per_layer + dispatch, output), adam_step
        )
        for mode in kept
    }
    assert activations["full"] == adam_step

    layout = "--model qwen3-30b-a3b --nodes 1 --gpus-per-node 8 --gpu-mem-gb 80 --tp 4 --ep 8"
    layout += " --etp 1 --micro-batch-tokens 16384"
    result = plan_cli(*layout.split(), "--json", "--recompute", "full")
    assert result.returncode == 3, result.stderr  # too big, even with full recompute
    plan = json.loads(result.stdout)
    per_gpu = plan["per_gpu"]
    assert plan["layout"] == dict(
        tp=4, pp=1, cp=1, ep=8, etp=1, dp=2, edp=1, sequence_parallel=True
    )
    assert plan["params_per_gpu"] == dense + expert == 4_018_747_392
    assert (per_gpu["dense_params"], per_gpu["expert_params"]) == (dense, expert)
    assert per_gpu["weight_bytes"] == weights == 8_037_494_784
    assert per_gpu["grad_bytes"] == grads == 16_074_989_568
    assert per_gpu["optimizer_bytes"] == optimizer == 45_855_756_288
    assert per_gpu["activation_bytes"] == activations
    state = weights + grads + optimizer  # 65.2 GiB
    # the stated terms: a 512 MiB context and two 32 MiB cuBLAS workspaces; 256 MiB for each
    # of 7 NCCL groups (world, TP, DPxCP, EP, TPxPP, ETPxEPxPP, the weight sync)
    untraced = 512 * 2**20 + 2 * 32 * 2**20 + 7 * 256 * 2**20
    assert plan["untraced_bytes"] == untraced
    assert [t["name"] for t in plan["untraced"]] == [
        "CUDA context + cuBLAS workspaces",
        "NCCL buffers, 7 groups",
    ]
    peaks = {mode: state + activations[mode] + untraced for mode in activations}
    assert plan["peak_bytes"] == peaks
    # 80 GiB with the 4 GiB reserve: not even with recompute, the optimizer step being over
    # (65.2 GiB of state + 14.2 of Adam's temporaries + 2.3 untraced); 86 GiB would hold it
    # with recompute.
    assert plan["fits"] == {"none": False, "selective": False, "full": False}
    assert 80 < peaks["full"] / GIB + 4 <= 86 < peaks["none"] / GIB + 4
    assert plan["longest_row"] == 16384 // 4 * 4 + 1
    refused = plan_cli(*layout.replace("80", "86").split())
    assert refused.returncode == 3 and "none no, selective yes, full yes" in refused.stdout


def test_entropies_and_expert_tensor_parallelism_add_what_the_formula_says():
    spec = load_hf_config("qwen3-30b-a3b")
    h, k, tokens = 2048, 8, 16384 // 4
    base = dict(micro_batch_tokens=16384)
    etp1 = ParallelConfig(tensor=4, expert=8, expert_tensor=1, sequence_parallel=True)
    plain = plan_layout(spec, etp1, 8, **base).stages[0].activation_bytes["none"]
    # Entropies: one more fp32 buffer of a chunk's logits on the last stage.
    with_entropy = plan_layout(spec, etp1, 8, entropies=True, **base).stages[0]
    assert with_entropy.activation_bytes["none"] - plain == LOSS_CHUNK_BYTES
    # ETP4 (EP2 on 8 GPUs): expert inputs all-gathered over ETP: 2hk per token more per
    # layer for each extra ETP rank, and the dispatch set grows by 4hk per extra ETP rank;
    # the dispatch set and the loss path are alive at different moments: the larger counts.
    etp4 = ParallelConfig(tensor=4, expert=2, expert_tensor=4, sequence_parallel=True)
    ep2 = ParallelConfig(tensor=4, expert=2, expert_tensor=1, sequence_parallel=True)
    wide = plan_layout(spec, etp4, 8, **base).stages[0].activation_bytes["none"]
    narrow = plan_layout(spec, ep2, 16, **base).stages[0].activation_bytes["none"]
    loss = loss_path_bytes(spec, 16384, 4, "bfloat16", entropies=False)
    dispatch = {etp: tokens * 2 * h * k * (2 + 2 * etp) for etp in (1, 4)}
    assert dispatch[1] < loss < dispatch[4]
    assert wide - narrow == 48 * tokens * 2 * h * k * 3 + dispatch[4] - loss


@pytest.mark.parametrize(
    "args, reason",
    [
        (["--tp", "8"], "TP 8 does not divide the 4 query groups"),
        (
            ["--tp", "4", "--ep", "8"],
            "world_size 8 is not divisible by expert_tensor (4) x expert"
            " (8) x pipeline (1) = 32 (ETP defaults to TP",
        ),
        (["--tp", "4", "--gpus-per-node", "6"], "world_size 6 is not divisible by tensor (4)"),
        (["--ep", "3", "--gpus-per-node", "6"], "EP 3 does not divide the 128 experts"),
        (["--pp", "5", "--gpus-per-node", "5"], "PP 5 does not divide the 48 layers"),
        (["--cp", "3"], "x context (3) = 3"),
    ],
)
def test_invalid_layouts_are_refused_with_the_reason(args, reason):
    base = ["--model", "qwen3-30b-a3b", "--nodes", "1", "--gpus-per-node", "8"]
    result = plan_cli(*base, *args)
    assert result.returncode == 2, result.stdout
    assert reason in result.stderr, result.stderr


def test_micro_batch_tokens_are_per_gpu_and_cp_lengthens_the_rows():
    """learner.micro_batch_tokens is what each GPU of a CP group holds: CP2 at the same setting
    keeps every GPU's activations but the attention's own, holds rows twice as long (the
    learner's longest_row), and a layout whose micro-batches cannot hold the recipe's rows is
    refused, naming both settings and the least micro_batch_tokens that would do."""
    spec = load_hf_config("qwen3-30b-a3b")
    base = dict(micro_batch_tokens=9216, params_dtype="bfloat16")
    one = plan_layout(spec, ParallelConfig(expert=8), 8, **base)
    two = plan_layout(spec, ParallelConfig(expert=4, context=2), 8, **base)
    # At CP2 a layer's attention keeps the keys and values gathered from both CP ranks (4 kv
    # bytes per token more: the first rank reads every key of its sequences) and each zigzag
    # chunk's output beside their concatenation (2 q): kept by all 48 layers without
    # recompute or with selective, by none with full recompute.
    q, kv = 32 * 128, 4 * 128
    extra = 9216 * (4 * kv + 2 * q)
    difference = {
        mode: two.stages[0].kept_bytes[mode] - one.stages[0].kept_bytes[mode]
        for mode in ("none", "selective", "full")
    }
    assert difference == {"none": 48 * extra, "selective": 48 * extra, "full": 0}
    assert (one.longest_row, two.longest_row) == (9217, 18433)
    tp4_cp2 = ParallelConfig(tensor=4, context=2, expert=8, expert_tensor=1, sequence_parallel=True)
    assert plan_layout(spec, tp4_cp2, 16, row_tokens=18432, **base).longest_row == 18433
    with pytest.raises(
        LayoutError,
        match=r"learner.micro_batch_tokens 9000 x parallel.context 2 "
        r"holds at most 18001; .* >= 9216",
    ):
        plan_layout(spec, tp4_cp2, 16, row_tokens=18432, micro_batch_tokens=9000)


def test_dense_model_refuses_expert_parallelism_and_counts_published_sizes():
    dense_with_ep = "--model qwen2.5-7b-instruct --nodes 1 --gpus-per-node 8 --ep 2 --json"
    result = plan_cli(*dense_with_ep.split())
    assert result.returncode == 2
    assert json.loads(result.stdout) == {
        "valid": False,
        "reason": "EP 2 set for a dense model (no experts)",
    }
    # Published totals: Qwen2.5-7B 7.62 B, Qwen2.5-Math-1.5B 1.54 B (tied embeddings).
    assert total_params(load_hf_config("qwen2.5-7b-instruct")) == 7_615_616_512
    assert total_params(load_hf_config("qwen2.5-math-1.5b")) == 1_543_714_304


def test_pipeline_stages_hold_their_own_layers_and_embeddings():
    spec = load_hf_config("qwen2.5-math-1.5b")  # 28 layers, tied embeddings
    plan = plan_layout(spec, ParallelConfig(pipeline=2), 2, micro_batch_tokens=1024)
    first, last = (stage.params.total for stage in plan.stages)
    embedding = spec.vocab_size * spec.hidden_size
    # Tied embeddings under PP keep a copy on the last stage, which also has the final norm.
    assert last - first == spec.hidden_size
    assert first + last == total_params(spec) + embedding
    # 1F1B: stage 0 keeps 2 micro-batches of its layers in flight, the last one 1, plus the
    # chunked loss path (bf16, TP1): 2h + 2h per token, one and a half chunks, 6 V h.
    h, vocab = spec.hidden_size, spec.vocab_size
    loss = 1024 * 4 * h + LOSS_CHUNK_BYTES * 3 // 2 + vocab * h * 6
    assert loss_path_bytes(spec, 1024, 1, "bfloat16", entropies=False) == loss
    first, last = (stage.kept_bytes["none"] for stage in plan.stages)
    assert first == 2 * last
    # at DP1 the optimizer step's fp32 temporary of each stage's parameters is its peak
    assert [s.activation_bytes["none"] for s in plan.stages] == [
        4 * s.params.total for s in plan.stages
    ]
    odd_vocab = dataclasses.replace(spec, vocab_size=spec.vocab_size + 1)
    with pytest.raises(LayoutError, match="TP 2 does not divide vocab_size 151937"):
        plan_layout(odd_vocab, ParallelConfig(tensor=2), 2, micro_batch_tokens=1024)


def test_enumeration_lists_fitting_layouts_best_first():
    cluster = "--model qwen3-30b-a3b --nodes 2 --gpus-per-node 8 --gpu-mem-gb 80"
    cluster += " --micro-batch-tokens 9216 --row-tokens 18432 --json"
    result = plan_cli(*cluster.split())
    assert result.returncode == 0, result.stderr
    plans = json.loads(result.stdout)
    layouts = [tuple(p["layout"][k] for k in ("tp", "cp", "pp", "ep", "etp")) for p in plans]
    assert (4, 2, 1, 8, 1) in layouts and len(set(layouts)) == len(layouts)
    assert all(p["layout"]["cp"] >= 2 for p in plans), "CP1 cannot hold 18,432-token rows"
    assert all(p["fits"]["full"] for p in plans) and plans[0]["fits"]["none"]
    assert all(p["layout"]["tp"] <= 8 and 4 % p["layout"]["tp"] == 0 for p in plans)
    least = [next(m for m in ("none", "selective", "full") if p["fits"][m]) for p in plans]
    order = {"none": 0, "selective": 1, "full": 2}
    assert [order[m] for m in least] == sorted(order[m] for m in least), "least recompute first"
    model_parallel = [
        p["layout"]["tp"] * p["layout"]["cp"] * p["layout"]["pp"]
        for p in plans
        if p["fits"]["none"]
    ]
    assert model_parallel == sorted(model_parallel)
    one_gpu = "--model qwen3-30b-a3b --nodes 1 --gpus-per-node 1 --gpu-mem-gb 80"
    nothing = plan_cli(*one_gpu.split())
    assert nothing.returncode == 3 and "no valid layout fits" in nothing.stdout


def test_the_launch_package_imports_no_torch():
    code = (
        "import sys, megatron_fr.launch.plan, megatron_fr.launch.slurm, megatron_fr.launch.submit;"
        "assert 'torch' not in sys.modules and 'megatron.core' not in sys.modules"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_untraced_terms_name_their_groups_and_the_sync_is_a_peak_candidate():
    from megatron_fr.launch.plan import nccl_groups, sync_bytes

    spec = load_hf_config("qwen3-30b-a3b")
    flagship = ParallelConfig(
        tensor=4, context=2, expert=8, expert_tensor=1, sequence_parallel=True
    )
    assert nccl_groups(flagship, 16) == [
        "world", "TP", "CP", "DPxCP", "EP", "EDP", "TPxPP", "ETPxEPxPP", "weight sync"
    ]  # fmt: skip
    assert nccl_groups(ParallelConfig(pipeline=2), 2, sender=False, moe=False) == [
        "world", "TPxPP", "PP previous", "PP next"
    ]  # fmt: skip
    assert nccl_groups(ParallelConfig(), 1) == ["weight sync"]
    # two buckets in flight (overlap), each at least the 151,936 x 2,048 bf16 embedding
    embedding = 151_936 * 2048 * 2
    assert sync_bytes(spec, "bfloat16", 512 * 2**20, overlap=True) == 2 * embedding
    assert sync_bytes(spec, "bfloat16", 1024 * 2**20, overlap=False) == 1024 * 2**20
    # a sync bigger than everything else after the step sets the peak (not added on top)
    small = dict(micro_batch_tokens=1024, gpu_mem_gib=80)
    one = plan_layout(load_hf_config("qwen2.5-math-1.5b"), ParallelConfig(), 8, **small)
    huge = plan_layout(
        load_hf_config("qwen2.5-math-1.5b"),
        ParallelConfig(),
        8,
        **small,
        sync_bucket_bytes=40 * GIB,
    )
    stage = huge.stages[0]
    assert stage.sync_bytes == 80 * GIB
    assert huge.peak_bytes("none") == stage.state_bytes + 80 * GIB + huge.untraced_bytes
    assert one.peak_bytes("none") < huge.peak_bytes("none")


def test_the_recipe_gives_the_world_the_layout_and_the_learner_settings():
    flags = "--model qwen3-30b-a3b --nodes 2 --gpus-per-node 8 --gpu-mem-gb 80 --tp 4 --cp 2"
    flags += " --ep 8 --etp 1 --micro-batch-tokens 9216 --row-tokens 18432 --recompute selective"
    explicit = plan_cli(*flags.split(), "--json")
    recipe = str(REPO / "examples" / "qwen3_30b_a3b_lag8.yaml")
    from_recipe = plan_cli("--recipe", recipe, "--gpu-mem-gb", "80", "--json")
    assert explicit.returncode == from_recipe.returncode == 0, from_recipe.stderr
    assert json.loads(from_recipe.stdout) == json.loads(explicit.stdout)
    assert json.loads(from_recipe.stdout)["world"] == 16
    # a flag overrides the recipe's value
    one_node = plan_cli("--recipe", recipe, "--nodes", "1", "--json")
    assert json.loads(one_node.stdout)["world"] == 8
