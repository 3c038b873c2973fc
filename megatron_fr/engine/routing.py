"""RoutedExperts: the experts an inference engine routed each position of a row to (MoE).

What it is for: routing replay. The learner recomputes a trajectory with its own router, and
small numeric differences from the engine (bf16 kernels, expert-parallel layouts, weights a
few versions apart) flip top-k choices, which changes the log-probs pi the importance ratio
and the trust-region gate are built on. The engine records which experts it used (SGLang's
`return_routed_experts`), the trajectory carries them, and the learner's routers use them
instead of their own top-k (learner/routing_replay.py).

Layout: experts[p, layer, j] = the j-th expert id position p was routed to in that layer, for
every position p the learner feeds to the model: p = 0 .. len(token_ids) - 2 (the last token is
never an input). That is what SGLang returns for a request with routed_experts_start_len = 0
(rows [start, prompt + output - 1); srt/managers/scheduler_components/batch_result_processor.py).

Storage: one byte per id when num_experts <= 256 (uint8), two above (int16). int8 would cap
the ids at 127, which is exactly Qwen3-30B-A3B's largest (128 experts) with no headroom;
uint8 also covers DeepSeek-V3's 256. For Qwen3-30B-A3B (48 layers, top-8): 48 x 8 = 384 bytes
per token, against 1,536 in SGLang's int32 wire format.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from megatron_fr.utils.array_json import array_from_json, array_to_json

STORAGE_DTYPES = (np.dtype(np.uint8), np.dtype(np.int16))
"""The compact dtypes a RoutedExperts may hold (see `storage_dtype`)."""


def storage_dtype(num_experts: int) -> np.dtype:
    """uint8 up to 256 experts, int16 up to 32,768 (the module docstring says why)."""
    if not 1 <= num_experts <= np.iinfo(np.int16).max + 1:
        raise ValueError(f"num_experts must be in [1, 32768], got {num_experts}")
    return STORAGE_DTYPES[0] if num_experts <= 256 else STORAGE_DTYPES[1]


@dataclass(frozen=True, eq=False)
class RoutedExperts:
    """Expert ids per position and layer, compactly stored. Validated where trajectories enter
    the buffer (buffer/trajectory.py), so a malformed record is counted there, never trained on."""

    experts: np.ndarray
    """[positions, layers, top_k] expert ids, uint8 or int16 (STORAGE_DTYPES)."""
    num_experts: int
    """Ids are in [0, num_experts): the model's routed experts."""

    @classmethod
    def compact(cls, experts: np.ndarray, num_experts: int) -> RoutedExperts:
        """From any integer array [positions, layers, top_k] (e.g. SGLang's int32), stored in
        the smallest dtype that holds every id below num_experts. Ids out of that range are
        refused here, since narrowing them would wrap them into a valid-looking id."""
        experts = np.asarray(experts)
        if experts.size and (experts.min() < 0 or experts.max() >= num_experts):
            raise ValueError(
                f"expert ids must be in [0, {num_experts}), got [{experts.min()}, {experts.max()}]"
            )
        return cls(np.ascontiguousarray(experts, dtype=storage_dtype(num_experts)), num_experts)

    @classmethod
    def concatenate(cls, parts: list[RoutedExperts]) -> RoutedExperts:
        """Consecutive position ranges (the segments or turns of one row) as one record."""
        if not parts:
            raise ValueError("concatenate needs at least one part")
        if len({p.num_experts for p in parts}) != 1:
            raise ValueError("parts disagree on num_experts")
        return cls(np.concatenate([p.experts for p in parts]), parts[0].num_experts)

    @property
    def positions(self) -> int:
        return int(self.experts.shape[0])

    def head(self, positions: int) -> RoutedExperts:
        """The first `positions` positions (a row cut back to its last policy token)."""
        return RoutedExperts(self.experts[:positions], self.num_experts)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RoutedExperts):
            return NotImplemented
        return (
            self.num_experts == other.num_experts
            and self.experts.dtype == other.experts.dtype
            and np.array_equal(self.experts, other.experts)
        )

    # A mutable array inside: not hashable, like the trajectory's lists. (Python's idiom for
    # an unhashable class; mypy types object.__hash__ as never None, so it needs the ignore.)
    __hash__ = None  # type: ignore[assignment]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (buffer checkpoints): the raw bytes in base64, little-endian."""
        return {**array_to_json(self.experts), "num_experts": self.num_experts}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RoutedExperts:
        return cls(array_from_json(data), int(data["num_experts"]))
