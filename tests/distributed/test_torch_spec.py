"""The torch layer spec (model.spec torch: torch's fused attention and grouped-GEMM experts)
computes what megatron's local spec computes, and they share every checkpoint format.

One spawn of 2 gloo ranks; a tiny Qwen3-MoE in float32 read from an HF directory by both
specs (the HF load names experts per spec), at EP2 with packed rows and several
micro-batches, EP2 with padded rows, TP2 x EP2 with sequence parallelism (ETP1), and CP2 with
packed rows. Per layout:
  - the learner's log-probs of every policy token agree to 1e-5;
  - one optimizer step (lr = adam_eps = 1, no clipping: Adam's first update of a parameter is
    g / (|g| + 1), one-to-one with its gradient g) gives the same loss, grad norm and updated
    weights to 1e-5, expert e's weights matched across the two namings;
  - the HF tensors the weight sync would send (weights/reshard.py) are the HF checkpoint's;
  - the model checkpoint one spec writes after its step starts a fresh learner of the other
    spec (init_checkpoint) that scores as the writer did; a run checkpoint (model and
    distributed-optimizer state, whose layout follows the spec's parameter order) resumes only
    with its own spec, and another spec's learner refuses it naming model.spec.
    .venv/bin/python -m pytest tests/distributed/test_torch_spec.py -q
"""

from __future__ import annotations

import re

import pytest
import torch
from test_packing_cp import long_tailed_batch
from tiny_qwen import TINY

from megatron_fr.parallel.spawn import run_on_ranks

CONFIG = dict(TINY["qwen3_moe"], router_aux_loss_coef=0.0)
LAYOUTS = [  # (name, ParallelConfig kwargs, learner.micro_batch_tokens, pack sequences)
    ("ep2 packed", dict(expert=2), 30, True),
    ("ep2 padded", dict(expert=2), 64, False),
    ("tp2xep2 sp", dict(tensor=2, sequence_parallel=True, expert=2, expert_tensor=1), 64, True),
    ("cp2 packed", dict(context=2), 24, True),
]
SPECS = ("local", "torch")
TOLERANCE = 1e-5
SEQUENTIAL = re.compile(r"\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$")


def common_name(name: str) -> str:
    """A parameter's name in the local spec's naming (the torch spec's experts are grouped:
    linear_fc1.weight{e} for local_experts.{e}.linear_fc1.weight)."""
    grouped = re.search(r"\.experts\.(linear_fc[12])\.weight(\d+)$", name)
    if grouped is None:
        return name
    linear, expert = grouped.groups()
    return name[: grouped.start()] + f".experts.local_experts.{expert}.{linear}.weight"


def learners(rank: int, world_size: int, hf_dir: str, batch, tmp: str):
    from megatron_fr.config import FlashReinforceConfig, LearnerConfig, ParallelConfig
    from megatron_fr.learner.trainer import Learner
    from megatron_fr.models.hf_config import load_hf_config
    from megatron_fr.parallel import state
    from megatron_fr.weights.reshard import iter_hf_buckets

    spec = load_hf_config(dict(CONFIG, model_type="qwen3_moe"))
    results = {}
    for name, kwargs, tokens, pack in LAYOUTS:
        parallel = ParallelConfig(**kwargs)
        config = LearnerConfig(
            params_dtype="float32",
            micro_batch_tokens=tokens,
            pack_sequences=pack,
            lr=1.0,
            adam_eps=1.0,
            clip_grad=0.0,
            flash_reinforce=FlashReinforceConfig(delta=2e-3),
        )
        for kind in SPECS:
            state.initialize(parallel, seed=0)
            learner = Learner(
                spec, parallel, config, total_steps=2, init_hf_dir=hf_dir, spec_kind=kind
            )
            sent = {
                n: t.clone() for bucket in iter_hf_buckets(learner.module, spec) for n, t in bucket
            }
            scored = learner.policy_log_probs(batch)
            micros = len(learner._micro_batches(learner.plan(batch), batch, 0, None))
            metrics = learner.train_step(batch)
            weights = {
                common_name(n): p.detach().clone() for n, p in learner.module.named_parameters()
            }
            directory = f"{tmp}/{name.replace(' ', '_')}_{kind}"
            save_model(learner.module, f"{directory}_model")
            learner.save(directory)
            results[name, kind] = dict(
                scored=scored,
                metrics=metrics,
                weights=weights,
                sent=sent,
                micros=micros,
                after=learner.policy_log_probs(batch),
            )
        for kind, other in (("local", "torch"), ("torch", "local")):
            state.initialize(parallel, seed=0)
            written = f"{tmp}/{name.replace(' ', '_')}_{other}"
            fresh = Learner(
                spec,
                parallel,
                config,
                total_steps=2,
                init_checkpoint=f"{written}_model",
                spec_kind=kind,
            )
            results[name, kind]["reloaded"] = fresh.policy_log_probs(batch)
            try:
                fresh.load(written)
                results[name, kind]["resume"] = "loaded"
            except ValueError as error:
                results[name, kind]["resume"] = str(error)
    return results


def save_model(module, directory: str) -> None:
    """The model's weights alone, as megatron's dist checkpoint (what conversion writes)."""
    from pathlib import Path

    from megatron.core import dist_checkpointing

    from megatron_fr.parallel.dist_checkpoint import keep_writes_in_process

    Path(directory).mkdir(parents=True, exist_ok=True)
    keep_writes_in_process()
    dist_checkpointing.save(module.sharded_state_dict(), directory)


@pytest.mark.distributed
def test_torch_spec_equals_the_local_spec_and_shares_its_checkpoints(tmp_path):
    from tiny_qwen import saved_tensors
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    torch.manual_seed(4)
    AutoModelForCausalLM.from_config(CONFIG_MAPPING["qwen3_moe"](**CONFIG)).save_pretrained(
        tmp_path / "hf"
    )
    hf = saved_tensors(tmp_path / "hf")
    batch = long_tailed_batch(size=8, seed=2)
    per_rank = run_on_ranks(learners, 2, str(tmp_path / "hf"), batch, str(tmp_path), timeout_s=900)
    for results in per_rank:
        for name, *_ in LAYOUTS:
            local, mine = results[name, "local"], results[name, "torch"]
            where = f"{name}"
            assert name == "tp2xep2 sp" or mine["micros"] > 1 or "padded" in name, where
            for a, b in zip(local["scored"], mine["scored"], strict=True):
                assert max(abs(x - y) for x, y in zip(a, b, strict=True)) <= TOLERANCE, where
            for key in ("loss", "grad_norm"):
                assert mine["metrics"][key] == pytest.approx(local["metrics"][key], abs=TOLERANCE)
            assert mine["metrics"]["admitted"] == local["metrics"]["admitted"], where
            assert local["weights"].keys() == mine["weights"].keys(), where
            for param, value in mine["weights"].items():
                diff = (value - local["weights"][param]).abs().max().item()
                assert diff <= TOLERANCE, f"{where}: {param} differs by {diff}"
            for kind in SPECS:  # the weight sync's HF tensors, as read from the HF directory
                for tensor_name, tensor in results[name, kind]["sent"].items():
                    assert torch.equal(tensor, hf[tensor_name]), f"{where} {kind} {tensor_name}"
            # a fresh learner of each spec started from the other's model checkpoint: its
            # stepped weights; the other's run checkpoint is refused, naming the setting
            for kind, other in (("local", "torch"), ("torch", "local")):
                reloaded, written = results[name, kind]["reloaded"], results[name, other]["after"]
                for a, b in zip(reloaded, written, strict=True):
                    assert max(abs(x - y) for x, y in zip(a, b, strict=True)) <= TOLERANCE, where
                assert f"with model.spec {other}" in results[name, kind]["resume"], where
            moved = max(
                abs(x - y)
                for a, b in zip(local["after"], local["scored"], strict=True)
                for x, y in zip(a, b, strict=True)
            )
            assert moved > 100 * TOLERANCE, f"{where}: the step should move the log-probs"
    senders = [r for r in per_rank if r[LAYOUTS[0][0], "torch"]["sent"]]
    assert senders and set(senders[0][LAYOUTS[0][0], "torch"]["sent"]) == set(hf)
