"""Routing replay through the real ranks. The CPU engine serves a tiny Qwen3-MoE in bfloat16
over HTTP and the real rollout client asks it for the routed experts; in each router, expert
2's row is expert 1's scaled by 1 + 2**-12, below bf16's resolution, so the bf16 engine sees a
tie the float32 learner does not, and top-k choices flip (the case replay is for). With
learner.routing_replay, on 2 gloo ranks at EP2 (several micro-batches, padded rows), TP2xEP2
(sequence parallel, ETP1, learner.recompute selective: every MoE block is re-run in the
backward) and PP2 with learner.recompute full (a later micro-batch's forward runs before an
earlier one's recomputation, which must still replay its own experts: megatron's
REPLAY_BACKWARD):
  - the experts megatron's routers choose for every token (forward hooks on them) are the
    engine's, each rank checking the tokens and layers it holds, together covering all;
  - the learner's log-probs, loss, acceptance and gradient norm equal those of transformers'
    model with its routers forced to the same experts (patched here: softmax over all experts,
    the given ids, renormalised, as Qwen3-MoE's norm_topk_prob);
  - without replay the learner routes some tokens elsewhere (so these checks can fail);
  - a learner resumed from a checkpoint continues exactly as the one that saved it.
    .venv/bin/python -m pytest -q tests/distributed/test_routing_replay.py   # ~30 s, 2 ranks
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import torch
from tiny_qwen import TINY

from megatron_fr.buffer.trajectory import Trajectory
from megatron_fr.parallel.spawn import run_on_ranks

CONFIG = dict(TINY["qwen3_moe"], router_aux_loss_coef=0.0)
NEAR_TIE = 1 + 2**-12
"""Expert 2's router row is expert 1's times this (module docstring)."""
DELTA = 1e-3
LAYOUTS = [  # (name, ParallelConfig kwargs, per-rank token budget, learner.recompute)
    ("ep2", dict(expert=2), 26, "none"),
    (
        "tp2xep2",
        dict(tensor=2, sequence_parallel=True, expert=2, expert_tensor=1),
        10_000,
        "selective",
    ),
    ("pp2", dict(pipeline=2), 26, "full"),
]
PROMPTS = [[3, 17, 42, 5], [9, 8], [100, 2, 64, 31, 7, 7], [11, 12, 13], [50, 60], [1, 2, 3, 4, 5]]


async def sample(hf_dir) -> list[Trajectory]:
    """One rollout per prompt from the CPU engine in bf16, routed experts included."""
    from aiohttp import web
    from trajectory_fixtures import single_turn_trajectory

    from megatron_fr.engine.client import RolloutClient, RolloutClientConfig
    from megatron_fr.engine.cpu.engine import CpuEngine
    from megatron_fr.engine.cpu.server import CpuServer
    from megatron_fr.engine.sglang.protocol import RoutedExpertsLayout, SamplingParams

    engine = CpuEngine(hf_dir, torch.bfloat16, return_routed_experts=True)
    engine.weight_version = "0"  # the learner's version of these weights
    runner = web.AppRunner(CpuServer(engine).app())
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        layout = RoutedExpertsLayout(num_layers=2, top_k=2, num_experts=4)
        config = RolloutClientConfig(
            urls=[f"http://127.0.0.1:{runner.addresses[0][1]}"], routed_experts=layout
        )
        sampling = SamplingParams(temperature=1.0, max_new_tokens=8)
        async with RolloutClient(config) as client:
            rollouts = await asyncio.gather(*(client.generate(p, sampling) for p in PROMPTS))
    finally:
        await runner.cleanup()
    return [
        single_turn_trajectory(f"p{k}", r, reward=float(k % 3) - 1.0, info={})
        for k, r in enumerate(rollouts)
    ]


@contextlib.contextmanager
def forced_routing(model, experts: torch.Tensor):
    """transformers' routers pick `experts` [tokens, layers, top_k] instead of their top-k;
    the routing weights stay the router's own softmax at those experts, renormalised."""
    originals = []
    for index, layer in enumerate(model.model.layers):
        gate = layer.mlp.gate

        def forward(hidden, gate=gate, index=index):
            logits = torch.nn.functional.linear(hidden.reshape(-1, gate.hidden_dim), gate.weight)
            chosen = experts[:, index].long()
            weights = torch.softmax(logits, dim=-1, dtype=torch.float).gather(1, chosen)
            weights = (weights / weights.sum(-1, keepdim=True)).to(logits.dtype)
            return logits, weights, chosen

        originals.append((gate, gate.forward))
        gate.forward = forward
    try:
        yield
    finally:
        for gate, original in originals:
            gate.forward = original


def reference(hf_dir, batch: list[Trajectory]):
    """(log-probs per trajectory, loss, acceptance, grad norm) of transformers' fp32 model
    routed as the engine did, with algo.flash_reinforce_loss."""
    from transformers import AutoModelForCausalLM

    from megatron_fr.algo.flash_reinforce import flash_reinforce_loss

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    width = max(t.length for t in batch) - 1
    log_probs, behavior = torch.zeros(len(batch), width), torch.zeros(len(batch), width)
    mask = torch.zeros(len(batch), width, dtype=torch.bool)
    for row, t in enumerate(batch):
        tokens = torch.tensor([t.token_ids])
        with forced_routing(model, torch.from_numpy(t.routed_experts.experts)):
            logits = model(tokens[:, :-1]).logits[0]
        scored = torch.log_softmax(logits, -1).gather(-1, tokens[0, 1:, None])[:, 0]
        log_probs[row, : t.length - 1] = scored
        behavior[row, : t.length - 1] = torch.tensor(t.behavior_log_probs[1:])
        mask[row, : t.length - 1] = torch.tensor(t.action_mask[1:])
    rewards = torch.tensor([t.reward for t in batch])
    loss, metrics = flash_reinforce_loss(log_probs, behavior, rewards, mask, delta=DELTA)
    loss.backward()
    norm = torch.sqrt(sum((p.grad**2).sum() for p in model.parameters() if p.grad is not None))
    policy = [log_probs[row][mask[row]].tolist() for row in range(len(batch))]
    return policy, loss.item(), metrics["acceptance_rate"].item(), norm.item()


class RouterSpy:
    """Every routing map megatron's routers return, per global layer, in call order."""

    def __init__(self, module):
        from megatron.core.transformer.moe.router import TopKRouter

        self.maps: dict[int, list[torch.Tensor]] = {}
        for router in module.modules():
            if isinstance(router, TopKRouter):
                self.maps[router.layer_number - 1] = []
                router.register_forward_hook(self._keep(router.layer_number - 1))

    def _keep(self, layer: int):
        return lambda _module, _args, output: self.maps[layer].append(output[1].clone())

    def compare(self, batch: list[Trajectory], micros) -> tuple[int, set]:
        """(tokens routed unlike the engine, the (trajectory, position, layer) checked) for the
        forward-only pass over `micros` (this rank's micro-batches) just run."""
        from megatron.core import parallel_state as ps

        differ, checked = 0, set()
        for layer, maps in self.maps.items():
            assert len(maps) == len(micros), "one router call per micro-batch"
            for micro, routing_map in zip(micros, maps, strict=True):
                rows, width = micro.input_ids.shape
                chosen = routing_map.view(-1, rows, routing_map.shape[-1])  # [s, b] order
                offset = ps.get_tensor_model_parallel_rank() * chosen.shape[0]
                if chosen.shape[0] == width:
                    offset = 0  # no sequence parallelism: every position is here
                segments = micro.loss_batch.segment_ids
                for s in range(chosen.shape[0]):
                    for row in range(rows):
                        index = int(segments[row, offset + s])
                        if index < 0:
                            continue  # padding
                        position = int(micro.positions[row, offset + s])  # in its trajectory
                        ids = batch[index].routed_experts.experts[position, layer]
                        engine = torch.zeros(chosen.shape[-1], dtype=torch.bool)
                        engine[torch.from_numpy(ids.astype("int64"))] = True
                        differ += int(not torch.equal(engine, chosen[s, row]))
                        checked.add((index, position, layer))
            maps.clear()
        return differ, checked


def rank_micro_batches(learner, batch, parallel):
    """This rank's micro-batches, built by the learner's own code (routing included)."""
    return learner._micro_batches(learner.plan(batch), batch, 0, learner.routing_replay)


def replay_on_rank(rank: int, world_size: int, hf_dir: str, batch: list[Trajectory], tmp: str):
    import json
    from pathlib import Path

    from megatron_fr.config import FlashReinforceConfig, LearnerConfig, ParallelConfig
    from megatron_fr.learner.trainer import Learner
    from megatron_fr.models.hf_config import load_hf_config
    from megatron_fr.parallel import state
    from megatron_fr.parallel.state import broadcast_from_rank0

    spec = load_hf_config(json.loads((Path(hf_dir) / "config.json").read_text()))
    state.initialize(ParallelConfig(), seed=0)
    batch = broadcast_from_rank0(batch if rank == 0 else None)  # as the controller hands it out
    results = {}
    for name, kwargs, budget, recompute in LAYOUTS:
        parallel = ParallelConfig(**kwargs)
        state.initialize(parallel, seed=0)
        config = LearnerConfig(
            params_dtype="float32",
            micro_batch_tokens=budget,
            lr=1e-3,
            routing_replay=True,
            flash_reinforce=FlashReinforceConfig(delta=DELTA),
            recompute=recompute,
        )
        learner = Learner(spec, parallel, config, total_steps=4, init_hf_dir=hf_dir)
        granularity = learner.module.config.recompute_granularity
        assert granularity == (None if recompute == "none" else recompute), name
        spy = RouterSpy(learner.module)
        micros = rank_micro_batches(learner, batch, parallel)
        scored = learner.policy_log_probs(batch)
        routed = spy.compare(batch, micros)
        own = None
        if name == "ep2":
            learner.policy_log_probs(batch, routing_replay=False)
            own = spy.compare(batch, micros)[0]
        first = learner.train_step(batch)
        resumed = None
        if name == "ep2":  # save after step 1, step 2; a fresh learner loads step 1, steps 2
            learner.save(f"{tmp}/step1")
            second = learner.train_step(batch)
            again = Learner(spec, parallel, config, total_steps=4)
            again.load(f"{tmp}/step1")
            resumed = (second, again.train_step(batch))
        results[name] = (len(micros), scored, routed, own, first, resumed)
    return results


@pytest.mark.distributed
def test_learner_routes_as_the_engine_and_matches_the_forced_routing_reference(tmp_path):
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    torch.manual_seed(11)
    model = AutoModelForCausalLM.from_config(CONFIG_MAPPING["qwen3_moe"](**CONFIG))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight[2] = layer.mlp.gate.weight[1] * NEAR_TIE
    model.save_pretrained(tmp_path / "hf")
    batch = asyncio.run(sample(tmp_path / "hf"))
    policy, loss, acceptance, grad_norm = reference(tmp_path / "hf", batch)
    every = {
        (i, p, layer)
        for i, t in enumerate(batch)
        for p in range(t.length - 1)
        for layer in range(2)
    }

    per_rank = run_on_ranks(
        replay_on_rank, 2, str(tmp_path / "hf"), batch, str(tmp_path), timeout_s=900
    )
    for name, *_ in LAYOUTS:
        micros, scored, _, _, first, _ = per_rank[0][name]
        assert per_rank[1][name][1] == scored and per_rank[1][name][4] == first, name
        assert name == "tp2xep2" or micros > 1, f"{name}: expected several micro-batches"
        differ = sum(rank[name][2][0] for rank in per_rank)
        checked = set().union(*(rank[name][2][1] for rank in per_rank))
        assert differ == 0, f"{name}: {differ} tokens routed unlike the engine"
        assert checked == every, f"{name}: routing of {len(every - checked)} tokens not seen"
        worst = max(
            abs(a - b)
            for s, r in zip(scored, policy, strict=True)
            for a, b in zip(s, r, strict=True)
        )
        assert worst <= 1e-5, f"{name}: log-probs vs forced-routing reference: {worst}"
        assert abs(first["loss"] - loss) <= 1e-5, f"{name}: loss {first['loss']} vs {loss}"
        assert first["acceptance_rate"] == pytest.approx(acceptance, abs=1e-6), name
        assert first["grad_norm"] == pytest.approx(grad_norm, rel=1e-4), name
    own = sum(rank["ep2"][3] for rank in per_rank)
    assert own > 0, "without replay the fp32 learner should route some tokens elsewhere"
    second, again = per_rank[0]["ep2"][5]
    assert again == second and second["loss"] != per_rank[0]["ep2"][4]["loss"]
