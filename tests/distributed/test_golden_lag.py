"""Golden behaviour at lag: two learner steps on 2 megatron ranks (EP2) on a stale batch, whose
tokens were sampled, and whose behaviour log-probs were scored, by a perturbed copy of the
learner's model (the policy a few versions back), at temperatures 1 and 0.7, with the
FlashREINFORCE gate on and off. Pinned in tests/golden/learner_lag.json: per trajectory the
gate's sequence KL and admission, and the step's loss, acceptance, clip fraction, grad norm
and a checksum of every rank's weights after the step.

The lag-0 golden run (tests/e2e/test_golden_steps.py) cannot see a wrong importance ratio, a
wrong gate denominator, a learner that recomputes behaviour log-probs or one that ignores the
temperature: at lag 0 the ratio is 1 and the gate admits all. Here the ratios are far from 1,
the gate holds some trajectories out, and the second step sees the same batch from moved
weights. Admissions are compared exactly, the rest within TOLERANCE (two runs on one machine
agree to float64 printing; the tolerance leaves room for other CPUs' float32 kernels). A change
that moves them is a change of numerics: if intended, regenerate with

    MEGATRON_FR_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/distributed/test_golden_lag.py

and say why in the commit."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch
from tiny_qwen import TINY, to_megatron_on_rank

from megatron_fr.buffer.trajectory import Trajectory
from megatron_fr.parallel.spawn import run_on_ranks

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "learner_lag.json"
TOLERANCE = {"rel": 1e-4, "abs": 1e-6}
CONFIG = dict(TINY["qwen3_moe"], router_aux_loss_coef=0.0)
CASES = [  # (temperature, gate delta): gated and ungated at T = 1 and 0.7
    (1.0, 8e-4),
    (1.0, math.inf),
    (0.7, 8e-4),
    (0.7, math.inf),
]
PERTURBATION = 0.05
"""Standard deviation of the noise added to every weight of the behaviour policy's copy: enough
to move per-token log-probs by tenths of a nat, so the gate's decisions differ by trajectory."""


def stale_batch(behaviour_dir: Path, temperature: float, size: int = 8) -> list[Trajectory]:
    """`size` trajectories sampled at `temperature` by the perturbed model, with its log-probs
    of the distribution it sampled from (softmax of logits / T), as an engine reports them."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(behaviour_dir, dtype=torch.float32)
    generator = torch.Generator().manual_seed(11)
    batch = []
    for index in range(size):
        prompt = torch.randint(2, 128, (3 + index % 3,), generator=generator).tolist()
        tokens, log_probs = list(prompt), []
        with torch.no_grad():
            for _ in range(4 + index % 5):
                logits = model(torch.tensor([tokens])).logits[0, -1] / temperature
                distribution = torch.log_softmax(logits.double(), -1)
                token = int(torch.multinomial(distribution.exp(), 1, generator=generator))
                tokens.append(token)
                log_probs.append(float(distribution[token]))
        response = len(tokens) - len(prompt)
        batch.append(
            Trajectory(
                f"p{index}",
                tokens,
                [False] * len(prompt) + [True] * response,
                [0.0] * len(prompt) + log_probs,
                [-1] * len(prompt) + [0] * response,
                float(index % 3 == 0),
            )
        )
    return batch


def steps_on_rank(rank: int, world_size: int, megatron_dir: str, batches: dict) -> list[dict]:
    from megatron_fr.config import FlashReinforceConfig, LearnerConfig, ParallelConfig
    from megatron_fr.learner.trainer import Learner
    from megatron_fr.models.hf_config import load_hf_config
    from megatron_fr.parallel import state

    parallel = ParallelConfig(expert=2)
    state.initialize(parallel, seed=0)
    spec = load_hf_config(dict(CONFIG, model_type="qwen3_moe"))
    results = []
    for temperature, delta in CASES:
        config = LearnerConfig(
            params_dtype="float32", lr=1e-3, flash_reinforce=FlashReinforceConfig(delta=delta)
        )
        learner = Learner(
            spec,
            parallel,
            config,
            total_steps=2,
            init_checkpoint=megatron_dir,
            temperature=temperature,
        )
        batch = batches[temperature]
        steps = []
        for _ in range(2):
            metrics = learner.train_step(batch)
            weights = [p.detach().double() for p in learner.module.parameters()]
            steps.append(
                {
                    key: metrics[key]
                    for key in (
                        "loss",
                        "acceptance_rate",
                        "clip_fraction",
                        "grad_norm",
                        "sequence_kl",
                        "admitted",
                    )
                }
                | {
                    "weight_sum": float(sum(w.sum() for w in weights)),
                    "weight_abs_sum": float(sum(w.abs().sum() for w in weights)),
                }
            )
        results.append({"temperature": temperature, "delta": delta, "steps": steps})
    return results


def measure(tmp_path: Path) -> dict:
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    torch.manual_seed(7)
    model = AutoModelForCausalLM.from_config(CONFIG_MAPPING["qwen3_moe"](**CONFIG))
    model.save_pretrained(tmp_path / "hf")
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(PERTURBATION * torch.randn_like(parameter))
    model.save_pretrained(tmp_path / "behaviour")
    run_on_ranks(to_megatron_on_rank, 1, str(tmp_path / "hf"), str(tmp_path / "m"))
    batches = {t: stale_batch(tmp_path / "behaviour", t) for t in {t for t, _ in CASES}}
    per_rank = run_on_ranks(steps_on_rank, 2, str(tmp_path / "m"), batches, timeout_s=900)
    for field in ("loss", "grad_norm", "sequence_kl", "admitted"):
        for case in range(len(CASES)):
            for step in range(2):
                first = per_rank[0][case]["steps"][step][field]
                assert per_rank[1][case]["steps"][step][field] == first, f"ranks differ: {field}"
    return {"ranks": per_rank}


def _approx(expected):
    if isinstance(expected, list):
        return [_approx(e) for e in expected]
    if isinstance(expected, bool | str):
        return expected
    return pytest.approx(expected, **TOLERANCE)


@pytest.mark.distributed
def test_two_steps_on_a_stale_batch_reproduce_the_golden_file(tmp_path):
    measured = json.loads(json.dumps(measure(tmp_path)))  # as the file holds it (inf: Infinity)
    if os.environ.get("MEGATRON_FR_UPDATE_GOLDEN") == "1":
        GOLDEN.write_text(json.dumps(measured, indent=1) + "\n")
    golden = json.loads(GOLDEN.read_text())
    cases = measured["ranks"][0]
    held_out = [not all(s["admitted"]) for c in cases if c["delta"] != math.inf for s in c["steps"]]
    assert all(held_out), "a gated step that held no trajectory out tests no gate"
    assert all(all(s["admitted"]) for c in cases if c["delta"] == math.inf for s in c["steps"])
    for rank, (got, want) in enumerate(zip(measured["ranks"], golden["ranks"], strict=True)):
        for g, w in zip(got, want, strict=True):
            for step, (gs, ws) in enumerate(zip(g["steps"], w["steps"], strict=True)):
                where = f"rank {rank}, T={w['temperature']}, delta={w['delta']}, step {step + 1}"
                assert gs["admitted"] == ws["admitted"], where
                for key, value in ws.items():
                    assert gs[key] == _approx(value), f"{where}: {key}"
