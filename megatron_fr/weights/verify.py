"""Syncs that verify themselves: after a weight sync every engine samples a short probe and the
learner scores the same tokens at the same version.

A push can go wrong without an error: an engine that loads the bytes into the wrong place, a
kernel that keeps a stale cache, an in-place update an inference library gets wrong. Training
would then go on against a behaviour policy that is not the learner's, and nothing else would
notice (the importance ratio would quietly absorb it). So, after a sync (every
`weights.verify_every`-th), rank 0 asks every engine of the pool for PROBE_NEW_TOKENS tokens
from a fixed prompt (seeded, at the rollouts' temperature, token log-probs returned), every
learner rank scores those tokens (Learner.policy_log_probs, the learner's own routing), and the
largest per-token |engine - learner| log-prob gap of each engine is the check's figure. An
engine past `weights.verify_tolerance`, or serving another version, or whose probe fails, is
reported; the pool takes it out (orchestrator/pool_sync.py). One short request per engine and
one forward over a few dozen tokens per check.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch.distributed as dist

from megatron_fr.buffer.trajectory import NON_POLICY_VERSION, Trajectory
from megatron_fr.engine.backends import backend_for
from megatron_fr.engine.http import EngineRequestError, post_json
from megatron_fr.engine.types import MalformedResponse, SamplingParams
from megatron_fr.engine.wire import EngineWire
from megatron_fr.parallel.state import broadcast_from_rank0

PROBE_PROMPT_TOKENS = 16
PROBE_NEW_TOKENS = 16
PROBE_SEED = 20261205
"""Seeds the probe's prompt and the engines' sampling of it: the same probe at every check."""

Score = Callable[[list[Trajectory]], list[list[float]]]
"""The learner's log-probs of every trajectory's policy tokens (every rank passes the same
list and gets the whole result): Learner.policy_log_probs."""


@dataclass(frozen=True)
class EngineCheck:
    url: str
    gap: float
    """Largest per-token |engine - learner| log-prob over the probe's tokens (inf when the
    engine's probe failed or it serves another version)."""
    mean_gap: float
    tokens: int
    problem: str | None = None
    """Why the engine failed the check (None: it passed)."""


def probe_prompt(vocab_size: int) -> list[int]:
    """The fixed prompt: PROBE_PROMPT_TOKENS ids drawn below the vocabulary's size."""
    rng = random.Random(PROBE_SEED)
    return [rng.randrange(1, vocab_size) for _ in range(PROBE_PROMPT_TOKENS)]


class SyncCheck:
    """Every rank's side of the check (module docstring)."""

    def __init__(
        self,
        score: Score,
        vocab_size: int,
        temperature: float,
        every: int,
        tolerance: float,
        timeout_s: float,
        top_logprobs_num: int = 0,
    ) -> None:
        self.score, self.temperature = score, temperature
        self.top_logprobs_num = top_logprobs_num
        self.every, self.tolerance, self.timeout_s = every, tolerance, timeout_s
        self.prompt = probe_prompt(vocab_size)

    def due(self, version: int) -> bool:
        return self.every > 0 and version % self.every == 0

    def run(
        self, urls: list[str] | None, version: int, wire: EngineWire | None = None
    ) -> list[EngineCheck]:
        """Every rank: rank 0 passes the pool's engines (the others None), which speak `wire`
        (None: SGLang's, which the CPU engine speaks too), and gets each one's check; the
        others get []. Every rank takes part in the learner's forward."""
        wire = wire or backend_for(None).wire
        probed = self._probe(urls, version, wire) if urls is not None else None
        probes = broadcast_from_rank0(probed)
        trajectories = [p for p in probes if isinstance(p, Trajectory)]
        scored = []
        if trajectories:  # the same on every rank: all of them score, or none
            scored = self.score(_enough_for_every_rank(trajectories))[: len(trajectories)]
        if urls is None:
            return []
        learner = iter(scored)
        return [
            self._judge(url, probe, version, next(learner) if isinstance(probe, Trajectory) else [])
            for url, probe in zip(urls, probes, strict=True)
        ]

    def _probe(self, urls: list[str], version: int, wire: EngineWire) -> list[Trajectory | str]:
        """Rank 0: each engine's probe as a trajectory, or why there is none."""
        sampling = SamplingParams(
            temperature=self.temperature,
            max_new_tokens=PROBE_NEW_TOKENS,
            sampling_seed=PROBE_SEED,
        )
        body = wire.generate_request(
            self.prompt,
            sampling,
            rid=f"sync-probe-{version}",
            top_logprobs_num=self.top_logprobs_num,
        )
        with ThreadPoolExecutor(max_workers=max(1, len(urls))) as pool:
            calls = [
                pool.submit(post_json, url, wire.generate_path, body, self.timeout_s)
                for url in urls
            ]
            return [
                self._as_probe(url, call.result, version, wire)
                for url, call in zip(urls, calls, strict=True)
            ]

    def _as_probe(
        self, url: str, answer: Callable[[], object], version: int, wire: EngineWire
    ) -> Trajectory | str:
        try:
            output = wire.parse_generate(answer(), self.top_logprobs_num)
        except (EngineRequestError, MalformedResponse) as error:
            return f"probe failed: {error}"
        if output.weight_version != str(version):
            return f"serves weight version {output.weight_version}, not {version}"
        if not output.output_ids:
            return "the probe generated no token"
        if output.top_logprobs_from:
            return f"no top-K log-probs for the first {output.top_logprobs_from} probe tokens"
        prompt, out = len(self.prompt), len(output.output_ids)
        return Trajectory(
            prompt_id=f"sync-probe:{url}",
            token_ids=np.array([*self.prompt, *output.output_ids]),
            action_mask=np.array([False] * prompt + [True] * out),
            behavior_log_probs=np.array([0.0] * prompt + list(output.output_logprobs)),
            token_versions=np.array([NON_POLICY_VERSION] * prompt + [version] * out),
            reward=0.0,
            top_logprobs=output.top_logprobs,
        )

    def _judge(
        self, url: str, probe: Trajectory | str, version: int, learner: list[float]
    ) -> EngineCheck:
        if isinstance(probe, str):
            return EngineCheck(url, float("inf"), float("inf"), 0, probe)
        engine = probe.behavior_log_probs[probe.action_mask]
        gaps = np.abs(engine - np.asarray(learner, dtype=np.float64))
        gap, mean = float(gaps.max()), float(gaps.mean())
        problem = None
        if not gap <= self.tolerance:  # a NaN fails too
            problem = (
                f"log-prob gap {gap:.3g} to the learner at version {version} exceeds "
                f"weights.verify_tolerance={self.tolerance:g}"
            )
        return EngineCheck(url, gap, mean, len(gaps), problem)


def _enough_for_every_rank(probes: list[Trajectory]) -> list[Trajectory]:
    """The probes repeated to a multiple of the world size (at least two), so that every
    data-parallel rank gets one to score (the learner's step plan needs a trajectory per DP
    rank), all in one group (a group estimator's plan needs whole groups of two or more;
    the advantages are not used); the first len(probes) results are the probes'."""
    world = dist.get_world_size()
    count = -(-len(probes) // world) * world
    count *= 2 if count < 2 else 1
    return [
        dataclasses.replace(
            probes[i % len(probes)],
            prompt_id=f"{probes[i % len(probes)].prompt_id}#{i}",
            info={"group": "sync-probe"},
        )
        for i in range(count)
    ]
