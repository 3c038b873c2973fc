"""The interface every weight transport implements, and the engines it talks to.

The sync (``weights/sync.py``) calls ``connect`` once, then per sync ``send`` for each of the
stage's buckets and ``finish_stage`` on the stage's sending rank, and ``commit`` on global
rank 0 after every stage has sent. Every engine call has a deadline (``timeout_s``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from megatron_fr.weights.reshard import Bucket


@dataclass(frozen=True)
class Engine:
    """An inference server: its URL and how many ranks it has in a weight-update group."""

    url: str
    tp_size: int = 1


class WeightTransport(ABC):
    needs_session = False
    """SGLang accepts /update_weights_from_distributed and _from_tensor only between
    /begin_weight_update and /end_weight_update; the sync opens and closes that session."""

    def __init__(self, engines: list[Engine], timeout_s: float):
        if not engines:
            raise ValueError("a weight transport needs at least one engine")
        self.engines, self.timeout_s = engines, timeout_s

    @property
    def urls(self) -> list[str]:
        return [engine.url for engine in self.engines]

    def connect(self, stage: int) -> None:  # noqa: B027  (optional hook)
        """Once, on the stage's sending rank, before the first sync."""

    @abstractmethod
    def send(self, bucket: Bucket) -> None:
        """One bucket of full HF tensors, on the stage's sending rank."""

    def finish_stage(self) -> None:  # noqa: B027  (optional hook)
        """After the stage's last bucket, on its sending rank."""

    def commit(self, version: str) -> None:  # noqa: B027  (optional hook)
        """On global rank 0, after every stage has sent everything."""
