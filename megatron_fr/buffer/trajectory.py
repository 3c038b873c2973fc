"""One episode as the learner consumes it, its validation, and its padded tensor form.

A trajectory is ONE row whatever its number of turns: the prompt, every policy turn and every
tool/environment observation, concatenated. Everything per token is aligned with `token_ids`
(index t describes token t), so the rollout side never has to think about the learner's
next-token shift; `to_tensors` documents where that shift happens.

Validation runs where trajectories enter the buffer, so a bad rollout is counted and reported
with the field at fault instead of surfacing later as a NaN or a shape error in the loss.
That includes the MoE routing a trajectory may carry for routing replay (engine/routing.py):
one record per position the learner feeds, every id a valid expert, no expert twice in a
token's top-k; and the engine's top-K log-probs it may carry for the top-K gate
(engine/top_logprobs.py): one row per policy token, distinct ids, log-probs of a distribution.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from megatron_fr.config.algo import MAX_GATE_TOP_K
from megatron_fr.engine.routing import STORAGE_DTYPES, RoutedExperts
from megatron_fr.engine.top_logprobs import ID_DTYPE, LOG_PROB_DTYPE, TopLogProbs
from megatron_fr.utils.array_json import array_from_json, array_to_json

NON_POLICY_VERSION = -1
"""token_versions entry of a token the policy did not generate (prompt, observation)."""
TOP_K_MASS_TOLERANCE = 1e-3
"""How far above 1 the probabilities of a token's top-K may sum (float32 rounding) before the
record is refused as not coming from one distribution."""


class InvalidTrajectory(ValueError):
    """A trajectory that cannot be trained on; `field` names the culprit, `reason` is a short
    fixed phrase (no per-instance numbers) so that rejections can be counted by kind."""

    def __init__(self, field: str, problem: str, detail: str = "") -> None:
        self.field = field
        self.problem = problem
        self.reason = f"{field}: {problem}"
        super().__init__(self.reason + (f" ({detail})" if detail else ""))


PER_TOKEN: dict[str, np.dtype] = {
    "token_ids": np.dtype(np.int32),
    "action_mask": np.dtype(np.bool_),
    "behavior_log_probs": np.dtype(np.float32),
    "token_versions": np.dtype(np.int32),
}
"""The per-token fields and the dtype each is stored in: 13 bytes a token (the learner feeds
int64 ids and float32 log-probs; the engines report float log-probs, which the loss reads in
float32 anyway)."""
_KINDS = {
    "token_ids": "iu",
    "action_mask": "b",
    "behavior_log_probs": "fiu",
    "token_versions": "iu",
}
_INT32 = np.iinfo(np.int32)


def _as_array(value: Any, name: str) -> np.ndarray:
    """`value` (a list or an array) in its field's dtype; a value of another kind, or integers
    beyond int32, stays as numpy reads it, for validation to name."""
    array = np.asarray(value)
    if not array.size:  # an empty list reads as float64
        return np.zeros(array.shape, dtype=PER_TOKEN[name])
    if array.dtype.kind not in _KINDS[name]:
        return array
    if (
        array.dtype.kind in "iu"
        and array.size
        and (array.min() < _INT32.min or array.max() > _INT32.max)
    ):
        return array
    return np.ascontiguousarray(array, dtype=PER_TOKEN[name])


@dataclass(frozen=True, eq=False)
class Trajectory:
    """One episode row. The per-token fields are numpy arrays (PER_TOKEN), all of
    len(token_ids); lists given to the constructor are converted."""

    prompt_id: str
    """Identifies the rollout slot in the buffer (admit / put / abandon use it)."""
    token_ids: np.ndarray
    """Prompt + response, all turns, tool/environment observations included."""
    action_mask: np.ndarray
    """True for tokens the policy generated; prompt and observation tokens are False."""
    behavior_log_probs: np.ndarray
    """log mu(token t | tokens < t) as the inference engine reported it when it sampled token t.
    Meaningful only under the action mask; 0.0 elsewhere."""
    token_versions: np.ndarray
    """Policy (weight) version that generated token t; NON_POLICY_VERSION for non-policy tokens.
    A partial rollout that spans a weight update carries several versions."""
    reward: float
    info: dict[str, Any] = field(default_factory=dict)
    """Free-form, JSON-serialisable facts about the episode (turns, env, finish reason...)."""
    routed_experts: RoutedExperts | None = None
    """The experts the engine routed positions 0 .. length - 2 to, for MoE routing replay
    (learner.routing_replay); None when the engines were not asked for them."""
    top_logprobs: TopLogProbs | None = None
    """The engine's top-K ids and log-probs of every policy token's sampling distribution, one
    row per policy token in order, for the top-K gate (learner.flash_reinforce.gate_kl = topk);
    None when the engines were not asked for them."""

    def __post_init__(self) -> None:
        for name in PER_TOKEN:
            object.__setattr__(self, name, _as_array(getattr(self, name), name))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Trajectory):
            return NotImplemented
        same_arrays = all(
            getattr(self, name).dtype == getattr(other, name).dtype
            and np.array_equal(getattr(self, name), getattr(other, name))
            for name in PER_TOKEN
        )
        scalars = ("prompt_id", "reward", "info", "routed_experts", "top_logprobs")
        return same_arrays and all(getattr(self, n) == getattr(other, n) for n in scalars)

    @property
    def length(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def num_policy_tokens(self) -> int:
        return int(self.action_mask.sum())

    @property
    def oldest_version(self) -> int:
        """The staleness of a trajectory is that of its OLDEST policy token."""
        versions = self.token_versions[self.action_mask]
        if not versions.size:
            raise InvalidTrajectory("action_mask", "has no policy token")
        return int(versions.min())

    def summary(self) -> TrajectorySummary:
        """What is logged of it (no tokens)."""
        return TrajectorySummary(
            self.prompt_id,
            self.reward,
            self.length,
            self.num_policy_tokens,
            self.oldest_version,
            self.info,
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (buffer checkpoints): each per-token array as its raw bytes."""
        data: dict[str, Any] = {name: array_to_json(getattr(self, name)) for name in PER_TOKEN}
        data |= {"prompt_id": self.prompt_id, "reward": self.reward, "info": self.info}
        if self.routed_experts is not None:
            data["routed_experts"] = self.routed_experts.to_dict()
        if self.top_logprobs is not None:
            data["top_logprobs"] = self.top_logprobs.to_dict()
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Trajectory:
        """to_dict's form; per-token lists (checkpoints written before arrays) are read too."""
        fields = dict(data)
        for name in PER_TOKEN:
            if isinstance(fields[name], dict):
                fields[name] = array_from_json(fields[name])
        if fields.get("routed_experts") is not None:
            fields["routed_experts"] = RoutedExperts.from_dict(fields["routed_experts"])
        if fields.get("top_logprobs") is not None:
            fields["top_logprobs"] = TopLogProbs.from_dict(fields["top_logprobs"])
        return cls(**fields)


@dataclass(frozen=True)
class TrajectorySummary:
    """A trajectory without its tokens: what the run's report logs of a batch (the names are
    Trajectory's, so either can be logged)."""

    prompt_id: str
    reward: float
    length: int
    num_policy_tokens: int
    oldest_version: int
    info: dict[str, Any]


def _check_lengths(t: Trajectory) -> None:
    for name, dtype in PER_TOKEN.items():
        array = getattr(t, name)
        if array.ndim != 1 or array.dtype != dtype:
            raise InvalidTrajectory(
                name, f"is not a flat {dtype} sequence", f"{array.dtype} of shape {array.shape}"
            )
    if not t.length:
        raise InvalidTrajectory("token_ids", "is empty")
    for name in ("action_mask", "behavior_log_probs", "token_versions"):
        n = getattr(t, name).shape[0]
        if n != t.length:
            raise InvalidTrajectory(
                name, "length differs from token_ids", f"{n} entries, token_ids has {t.length}"
            )


def _first(flags: np.ndarray) -> int | None:
    """Index of the first True, or None."""
    found = np.flatnonzero(flags)
    return int(found[0]) if found.size else None


def _check_tokens(t: Trajectory) -> None:
    bad = _first(t.token_ids < 0)
    if bad is not None:
        raise InvalidTrajectory("token_ids", "holds a negative id", f"index {bad}")
    if not t.action_mask.any():
        raise InvalidTrajectory("action_mask", "has no policy token")
    if t.action_mask[0]:
        # The learner predicts token t from tokens < t; token 0 has nothing to be predicted from.
        raise InvalidTrajectory("action_mask", "marks token 0 as a policy token")


def _check_policy_values(t: Trajectory) -> None:
    mask, lps, versions = t.action_mask, t.behavior_log_probs, t.token_versions
    bad = _first(mask & ~np.isfinite(lps))
    if bad is not None:
        raise InvalidTrajectory(
            "behavior_log_probs", "not finite under the action mask", f"index {bad}: {lps[bad]}"
        )
    bad = _first(mask & (lps > 0))
    if bad is not None:
        raise InvalidTrajectory(
            "behavior_log_probs", "positive under the action mask", f"index {bad}: {lps[bad]}"
        )
    bad = _first(mask & (versions < 0))
    if bad is not None:
        raise InvalidTrajectory(
            "token_versions", "negative on a policy token", f"index {bad}: {versions[bad]}"
        )
    bad = _first(~mask & (versions != NON_POLICY_VERSION))
    if bad is not None:
        raise InvalidTrajectory(
            "token_versions",
            f"not {NON_POLICY_VERSION} on a non-policy token",
            f"index {bad}: {versions[bad]}",
        )


def _check_episode(t: Trajectory) -> None:
    if not isinstance(t.prompt_id, str) or not t.prompt_id:
        raise InvalidTrajectory("prompt_id", "is not a non-empty string", repr(t.prompt_id))
    if not isinstance(t.reward, int | float) or not math.isfinite(t.reward):
        raise InvalidTrajectory("reward", "not finite", repr(t.reward))
    try:
        json.dumps(t.info)
    except (TypeError, ValueError) as error:
        raise InvalidTrajectory("info", "is not JSON-serialisable", str(error)) from None


def _check_routing(t: Trajectory) -> None:
    """The routed experts, when present: [length - 1, layers, top_k] in a compact dtype, ids in
    [0, num_experts), no expert twice in one token's top-k of one layer."""
    routing = t.routed_experts
    if routing is None:
        return
    if not isinstance(routing, RoutedExperts) or not isinstance(routing.experts, np.ndarray):
        raise InvalidTrajectory("routed_experts", "is not a RoutedExperts array", repr(routing))
    experts = routing.experts
    if experts.ndim != 3 or experts.shape[1] < 1 or experts.shape[2] < 1:
        raise InvalidTrajectory(
            "routed_experts", "is not [positions, layers, top_k]", f"shape {experts.shape}"
        )
    if experts.shape[0] != t.length - 1:
        raise InvalidTrajectory(
            "routed_experts",
            "positions differ from the tokens fed (length - 1)",
            f"{experts.shape[0]} positions, {t.length} tokens",
        )
    if experts.dtype not in STORAGE_DTYPES:
        raise InvalidTrajectory("routed_experts", "dtype is not uint8 or int16", str(experts.dtype))
    if not 1 <= experts.shape[2] <= routing.num_experts:
        raise InvalidTrajectory(
            "routed_experts",
            "top_k is not in [1, num_experts]",
            f"top_k {experts.shape[2]}, {routing.num_experts} experts",
        )
    if experts.size and (experts.min() < 0 or experts.max() >= routing.num_experts):
        bad = np.argwhere((experts < 0) | (experts >= routing.num_experts))[0].tolist()
        raise InvalidTrajectory(
            "routed_experts",
            "expert id out of range",
            f"[position, layer, k] {bad}: {experts[tuple(bad)]} not in [0, {routing.num_experts})",
        )
    twice = np.zeros(experts.shape[:2], dtype=bool)  # pairwise: faster than sorting each top-k
    for i in range(experts.shape[2]):
        for j in range(i + 1, experts.shape[2]):
            twice |= experts[..., i] == experts[..., j]
    repeated = np.argwhere(twice)
    if repeated.size:
        raise InvalidTrajectory(
            "routed_experts",
            "repeats an expert within a top-k",
            f"[position, layer] {repeated[0].tolist()}",
        )


def _check_top_logprobs(t: Trajectory) -> None:
    """The top-K record, when present: [policy tokens, K] int32 ids and float32 log-probs, K in
    [1, MAX_GATE_TOP_K], ids >= 0 and distinct within a token, log-probs finite and <= 0, and
    a token's K probabilities summing to at most 1 (they are of one distribution)."""
    top = t.top_logprobs
    if top is None:
        return
    ids, log_probs = (getattr(top, "ids", None), getattr(top, "log_probs", None))
    if not (
        isinstance(top, TopLogProbs)
        and isinstance(ids, np.ndarray)
        and isinstance(log_probs, np.ndarray)
    ):
        raise InvalidTrajectory("top_logprobs", "is not a TopLogProbs of arrays", repr(top))
    if ids.dtype != ID_DTYPE or log_probs.dtype != LOG_PROB_DTYPE:
        raise InvalidTrajectory(
            "top_logprobs",
            "dtypes are not int32 ids and float32 log-probs",
            f"{ids.dtype}, {log_probs.dtype}",
        )
    if ids.ndim != 2 or ids.shape != log_probs.shape or not 1 <= ids.shape[1] <= MAX_GATE_TOP_K:
        raise InvalidTrajectory(
            "top_logprobs",
            f"is not [policy tokens, K] with K in [1, {MAX_GATE_TOP_K}]",
            f"ids {ids.shape}, log_probs {log_probs.shape}",
        )
    if ids.shape[0] != t.num_policy_tokens:
        detail = f"{ids.shape[0]} rows, {t.num_policy_tokens} policy tokens"
        raise InvalidTrajectory("top_logprobs", "rows differ from the policy tokens", detail)
    _check_top_values(ids, log_probs)


def _check_top_values(ids: np.ndarray, log_probs: np.ndarray) -> None:
    for bad, problem in (
        (ids < 0, "holds a negative id"),
        (~np.isfinite(log_probs) | (log_probs > 0), "log-prob not finite or positive"),
    ):
        if bad.any():
            index = np.argwhere(bad)[0].tolist()
            raise InvalidTrajectory("top_logprobs", problem, f"[policy token, k] {index}")
    ordered = np.sort(ids, axis=1)
    repeated = np.argwhere((ordered[:, 1:] == ordered[:, :-1]).any(axis=1))
    if repeated.size:
        raise InvalidTrajectory(
            "top_logprobs", "repeats a token within a top-K", f"policy token {int(repeated[0][0])}"
        )
    mass = np.exp(log_probs.astype(np.float64)).sum(axis=1)
    over = np.argwhere(mass > 1 + TOP_K_MASS_TOLERANCE)
    if over.size:
        row = int(over[0][0])
        raise InvalidTrajectory(
            "top_logprobs",
            "probabilities of a top-K sum above 1",
            f"policy token {row}: {mass[row]:.6g}",
        )


def validate_trajectory(t: Trajectory) -> Trajectory:
    """Return `t` unchanged if the learner can train on it; raise InvalidTrajectory otherwise."""
    _check_episode(t)
    _check_lengths(t)
    _check_tokens(t)
    _check_policy_values(t)
    _check_routing(t)
    _check_top_logprobs(t)
    return t


def to_tensors(trajectories: list[Trajectory], pad_id: int = 0) -> dict[str, Tensor]:
    """Right-padded batch of B validated trajectories, T = the longest length.

    Returns token_ids [B, T] long (pad_id on padding), action_mask [B, T] bool (False on
    padding), behavior_log_probs [B, T] float32 (0 off the mask), rewards [B] float32 and
    lengths [B] long.

    Alignment: index t of every [B, T] tensor describes TOKEN t: behavior_log_probs[b, t] is
    log mu(token_ids[b, t] | token_ids[b, :t]) and action_mask[b, t] says token t is a policy
    token (action_mask[:, 0] is always False). A causal LM's logits at position t predict token
    t + 1, so the learner feeds token_ids[:, :-1] and scores the targets token_ids[:, 1:]
    against behavior_log_probs[:, 1:] under action_mask[:, 1:].
    """
    if not trajectories:
        raise ValueError("to_tensors needs at least one trajectory")
    if pad_id < 0:
        raise ValueError(f"pad_id must be a token id >= 0, got {pad_id}")
    for t in trajectories:
        validate_trajectory(t)
    batch, width = len(trajectories), max(t.length for t in trajectories)
    token_ids = torch.full((batch, width), pad_id, dtype=torch.long)
    action_mask = torch.zeros((batch, width), dtype=torch.bool)
    log_probs = torch.zeros((batch, width), dtype=torch.float32)
    for row, t in enumerate(trajectories):
        mask = torch.from_numpy(t.action_mask)
        token_ids[row, : t.length] = torch.from_numpy(t.token_ids)
        action_mask[row, : t.length] = mask
        row_lps = torch.from_numpy(t.behavior_log_probs)
        log_probs[row, : t.length] = torch.where(mask, row_lps, 0.0)
    return {
        "token_ids": token_ids,
        "action_mask": action_mask,
        "behavior_log_probs": log_probs,
        "rewards": torch.tensor([t.reward for t in trajectories], dtype=torch.float32),
        "lengths": torch.tensor([t.length for t in trajectories], dtype=torch.long),
    }
