"""TopLogProbs: the engine's K most likely tokens, and their log-probs, of the distribution each
policy token of a row was sampled from.

What it is for: the optional top-K trust region (learner.flash_reinforce.gate_kl = topk,
docs/algorithm.md). The learner scores the same K ids under its current policy, puts the rest
of the vocabulary's mass in one tail bucket on both sides, and gates each trajectory on the
mean KL over those K + 1 buckets.

Layout: row j describes the j-th POLICY token of the row, in row order (nothing is stored for
prompt or observation tokens): ids[j, k] is the k-th most likely token of the distribution
that token was drawn from, log_probs[j, k] its log-prob there, in descending order. That is
SGLang's meta_info.output_top_logprobs for a request with top_logprobs_num = K (per output
token, K entries [logprob, token_id, text|null]; srt/managers/tokenizer_manager.py:
detokenize_top_logprobs_tokens), the log-probs of the temperature-scaled distribution the
token was sampled from, clamped to the float's smallest value instead of -inf.

Storage: int32 ids and float32 log-probs, K x 8 bytes per policy token (config/algo.py:
TOP_K_ENTRY_BYTES). Validated where trajectories enter the buffer (buffer/trajectory.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from megatron_fr.utils.array_json import array_from_json, array_to_json

ID_DTYPE = np.dtype(np.int32)
LOG_PROB_DTYPE = np.dtype(np.float32)


@dataclass(frozen=True, eq=False)
class TopLogProbs:
    """Top-K ids and log-probs per policy token (module doc)."""

    ids: np.ndarray
    """[policy tokens, K] int32 token ids."""
    log_probs: np.ndarray
    """[policy tokens, K] float32, each finite and <= 0."""

    @classmethod
    def of(
        cls, ids: Sequence | np.ndarray, log_probs: Sequence | np.ndarray, k: int
    ) -> TopLogProbs:
        """From any nested [tokens][K] lists or arrays (none: an empty [0, K] record); log-probs
        below float32's range become its smallest value, as SGLang clamps -inf."""
        floor = np.finfo(LOG_PROB_DTYPE).min
        log_probs = np.maximum(np.asarray(log_probs, dtype=np.float64), floor)
        return cls(
            np.asarray(ids, dtype=ID_DTYPE).reshape(-1, k),
            log_probs.astype(LOG_PROB_DTYPE).reshape(-1, k),
        )

    @classmethod
    def concatenate(cls, parts: list[TopLogProbs]) -> TopLogProbs:
        """The records of consecutive policy tokens (segments, turns) as one."""
        if not parts:
            raise ValueError("concatenate needs at least one part")
        if len({part.k for part in parts}) != 1:
            raise ValueError(f"parts disagree on K: {sorted({part.k for part in parts})}")
        return cls(
            np.concatenate([p.ids for p in parts]), np.concatenate([p.log_probs for p in parts])
        )

    @property
    def tokens(self) -> int:
        return int(self.ids.shape[0])

    @property
    def k(self) -> int:
        return int(self.ids.shape[-1])

    def __eq__(self, other: object) -> bool:
        # Defining __eq__ leaves the class unhashable (Python sets __hash__ to None): arrays
        # inside, like the trajectory's lists.
        if not isinstance(other, TopLogProbs):
            return NotImplemented
        return all(
            a.dtype == b.dtype and np.array_equal(a, b)
            for a, b in ((self.ids, other.ids), (self.log_probs, other.log_probs))
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (rollout-state checkpoints)."""
        return {"ids": array_to_json(self.ids), "log_probs": array_to_json(self.log_probs)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TopLogProbs:
        return cls(array_from_json(data["ids"]), array_from_json(data["log_probs"]))
