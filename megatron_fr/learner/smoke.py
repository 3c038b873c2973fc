"""CPU smoke run: a tiny megatron GPT learns a toy reward with the FlashREINFORCE loss.

    .venv/bin/megatron-fr smoke --tp 2 --steps 8

Every step, on every rank: sample B responses from the current model (full-vocab logits
gathered over TP, the same seeded sampler on every rank, behaviour log-probs recorded at
sampling time, as an inference engine does), reward each response by the fraction of its
tokens equal to a target token, then one FlashREINFORCE step through the parallel loss path
on vocab-parallel logits. Rising reward shows the whole chain — megatron model under TP on
gloo, vocab-parallel log-probs, gate, loss, backward, optimizer — works on this machine.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SmokeConfig:
    tensor_parallel: int = 2
    steps: int = 12
    batch: int = 32
    prompt_length: int = 4
    response_length: int = 12
    vocab: int = 16
    target_token: int = 7
    learning_rate: float = 1e-2
    delta: float = 3e-3
    seed: int = 0


def build_model(config: SmokeConfig):
    """A 2-layer dense Qwen3-shaped GPT (RMSNorm, q/k norm, SwiGLU, GQA, RoPE), fp32."""
    from megatron_fr.config import ParallelConfig
    from megatron_fr.models.gpt import build_gpt_model
    from megatron_fr.models.hf_config import HFModelSpec

    spec = HFModelSpec(
        model_type="qwen3",
        vocab_size=config.vocab,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        max_position_embeddings=config.prompt_length + config.response_length,
        tie_word_embeddings=False,
        qkv_bias=False,
        qk_layernorm=True,
    )
    parallel = ParallelConfig(tensor=config.tensor_parallel)
    return build_gpt_model(spec, parallel, params_dtype=torch.float32)


def _forward(model, tokens: torch.Tensor, gather: bool) -> torch.Tensor:
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    return model(tokens, positions, attention_mask=None, runtime_gather_output=gather)


@torch.no_grad()
def sample(model, prompts: torch.Tensor, config: SmokeConfig, generator: torch.Generator):
    """(tokens [B, P+R], behaviour log-probs of each sampled token [B, R])."""
    tokens, behavior = prompts, []
    for _ in range(config.response_length):
        log_probs = torch.log_softmax(_forward(model, tokens, gather=True)[:, -1].double(), -1)
        choice = torch.multinomial(log_probs.exp(), 1, generator=generator)
        behavior.append(log_probs.gather(-1, choice))
        tokens = torch.cat([tokens, choice], dim=1)
    return tokens, torch.cat(behavior, dim=1)


def learner_step(model, optimizer, tokens, behavior, rewards, config: SmokeConfig) -> dict:
    from megatron.core import parallel_state as ps

    from megatron_fr.config import FlashReinforceConfig
    from megatron_fr.parallel.loss import GlobalBatch, LossBatch, flash_reinforce_parallel_loss

    batch, length = tokens.shape
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    mask = torch.zeros(batch, length - 1, dtype=torch.bool)
    mask[:, config.prompt_length - 1 :] = True
    mu = torch.zeros(batch, length - 1, dtype=torch.float32)
    mu[:, config.prompt_length - 1 :] = behavior.float()
    loss_batch = LossBatch(
        target_ids=targets,
        behavior_log_probs=mu,
        action_mask=mask,
        segment_ids=torch.arange(batch)[:, None].expand(batch, length - 1),
        positions=torch.arange(length - 1).expand(batch, length - 1),
    )
    global_batch = GlobalBatch(advantages=(rewards - rewards.mean()).float())
    optimizer.zero_grad()
    loss, metrics = flash_reinforce_parallel_loss(
        _forward(model, inputs, gather=False),
        loss_batch,
        global_batch,
        FlashReinforceConfig(delta=config.delta),
        tp_group=ps.get_tensor_model_parallel_group(),
    )
    loss.backward()
    optimizer.step()
    return dict(loss=loss.item(), acceptance=metrics["acceptance_rate"].item())


def run_rank(rank: int, world_size: int, config: SmokeConfig) -> list[dict]:
    from megatron_fr.config import ParallelConfig
    from megatron_fr.parallel import state

    state.initialize(ParallelConfig(tensor=config.tensor_parallel), seed=config.seed)
    model = build_model(config)
    optimizer = torch.optim.Adam(model.parameters(), lr=config.learning_rate)
    generator = torch.Generator().manual_seed(config.seed)  # identical on every rank
    history = []
    for step in range(config.steps):
        prompts = torch.randint(
            0, config.vocab, (config.batch, config.prompt_length), generator=generator
        )
        model.eval()
        tokens, behavior = sample(model, prompts, config, generator)
        responses = tokens[:, config.prompt_length :]
        rewards = (responses == config.target_token).double().mean(1)
        model.train()
        row = learner_step(model, optimizer, tokens, behavior, rewards, config)
        row.update(step=step, reward=rewards.mean().item())
        history.append(row)
        if rank == 0:
            print(
                f"step {step:3d}  reward {row['reward']:.3f}  loss {row['loss']:+.5f}  "
                f"acceptance {row['acceptance']:.2f}",
                flush=True,
            )
    return history


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = SmokeConfig()
    parser.add_argument("--tp", type=int, default=defaults.tensor_parallel, help="TP ranks")
    parser.add_argument("--steps", type=int, default=defaults.steps, help="optimizer steps")
    parser.add_argument("--batch", type=int, default=defaults.batch, help="trajectories/step")
    parser.add_argument("--lr", type=float, default=defaults.learning_rate, help="Adam lr")


def main(args: argparse.Namespace) -> int:
    from megatron_fr.parallel.spawn import run_on_ranks

    config = SmokeConfig(
        tensor_parallel=args.tp, steps=args.steps, batch=args.batch, learning_rate=args.lr
    )
    history = run_on_ranks(run_rank, config.tensor_parallel, config, timeout_s=1800)[0]
    first, last = history[0]["reward"], history[-1]["reward"]
    print(f"smoke: reward {first:.3f} -> {last:.3f} over {len(history)} steps (TP{args.tp})")
    return 0
