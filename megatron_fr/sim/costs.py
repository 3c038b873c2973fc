"""The time formulas of a simulated run: decode speed under batching, learner step time from
the model's FLOPs, weight-sync time. Pure arithmetic; the event loop (sim/engine.py) calls them.

Decode (one server, c requests running):
    t(c) = t0 + t1 * c                  seconds per decode iteration (one token per request)
    per request 1 / t(c) tokens/s,      whole server c / t(c) -> 1 / t1 as c grows
    t1 = 1 / peak_tokens_per_s,         t0 = 1 / single_stream_tokens_per_s - t1
t0 is the part of an iteration every request shares (reading the weights), t1 what each one
adds (its attention over its KV cache, its share of the expert GEMMs). Context length, KV
memory and speculative decoding are not modelled; max_running_requests caps c.

Learner step (one optimizer step on a batch of trajectories of lengths S_i, prompt included):
    FLOPs   = sum_i (6 * N_active * S_i + 6 * L * q * S_i^2)
    seconds = step_overhead_s + FLOPs / (learner GPUs * peak_tflops_per_gpu * 1e12 * mfu)
N_active is the matmul weights one token passes through (attention projections, the MLP or,
for MoE, the router and top-k experts, the output layer; the input embedding is a lookup and
norms are elementwise, so neither counts), L the layers, q = heads x head_dim. 6 N S is
forward (2) + backward (4) of the matmuls (Kaplan et al. 2020); causal attention adds QK^T and
AV, 2 * 2 * q * i FLOPs per layer for the token at position i, so 2 L q S^2 forward over a
sequence and 6 L q S^2 with the backward. Activation recompute is not counted as model FLOPs:
it shows up as a lower mfu.

Weight sync:
    seconds = latency_s + bytes / (bandwidth_gb_s * 1e9),  bytes = 2 * params_total (bf16)
by default; the servers decode nothing meanwhile (they are paused for the update).
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_fr.launch.plan import total_params
from megatron_fr.models.hf_config import HFModelSpec, load_hf_config
from megatron_fr.sim.config import LearnerSettings, ServerSettings, SyncSettings

BF16_BYTES = 2


@dataclass(frozen=True)
class DecodeModel:
    """Per-request decode speed as a function of the requests a server runs at once."""

    shared_s: float
    """t0: seconds of a decode iteration that do not grow with the batch."""
    per_request_s: float
    """t1: seconds each running request adds to an iteration."""

    @classmethod
    def from_settings(cls, server: ServerSettings) -> DecodeModel:
        per_request = 1.0 / server.peak_tokens_per_s
        return cls(1.0 / server.single_stream_tokens_per_s - per_request, per_request)

    def tokens_per_s(self, running: int) -> float:
        """Speed of each of `running` requests (0 when none runs)."""
        if running <= 0:
            return 0.0
        return 1.0 / (self.shared_s + self.per_request_s * running)

    @property
    def peak_tokens_per_s(self) -> float:
        return 1.0 / self.per_request_s


def active_params_per_token(spec: HFModelSpec) -> int:
    """Weights of the matmuls one token goes through (module docstring). Norm weights and
    biases scale or shift elementwise, so they count for no matmul FLOPs and are left out."""
    h = spec.hidden_size
    q = spec.num_attention_heads * spec.head_dim
    kv = spec.num_key_value_heads * spec.head_dim
    attention = h * (q + 2 * kv) + q * h
    if spec.is_moe:  # router + the top-k experts (gate, up, down)
        mlp = spec.num_experts * h + spec.num_experts_per_tok * 3 * h * spec.moe_intermediate_size
    else:
        mlp = 3 * h * spec.intermediate_size
    return spec.num_layers * (attention + mlp) + spec.vocab_size * h


def training_flops(spec: HFModelSpec, sequence_lengths: list[int]) -> float:
    """Model FLOPs of one forward + backward over these sequences (module docstring)."""
    active = active_params_per_token(spec)
    attention = spec.num_layers * spec.num_attention_heads * spec.head_dim
    return float(sum(6 * active * s + 6 * attention * s * s for s in sequence_lengths))


class LearnerCost:
    """Seconds of one learner step for a batch, on `gpus` learner GPUs."""

    def __init__(self, settings: LearnerSettings, gpus: int) -> None:
        self.settings, self.gpus = settings, gpus
        self.spec = None if settings.seconds_per_step else load_hf_config(settings.model)

    def step_seconds(self, sequence_lengths: list[int]) -> float:
        s = self.settings
        if s.seconds_per_step is not None:
            return s.seconds_per_step
        if self.spec is None:  # read in __init__ whenever seconds_per_step is unset
            raise RuntimeError("no model config to count a step's FLOPs with")
        rate = self.gpus * s.peak_tflops_per_gpu * 1e12 * s.mfu
        return s.step_overhead_s + training_flops(self.spec, sequence_lengths) / rate


def sync_seconds(settings: SyncSettings, model: str) -> float:
    """Seconds of one weight sync (module docstring); the model sets the default byte count."""
    sent = settings.bytes
    if sent is None:
        sent = BF16_BYTES * total_params(load_hf_config(model))
    return settings.latency_s + sent / (settings.bandwidth_gb_s * 1e9)
