"""The interface every weight transport implements, and the engines it talks to.

The sync (``weights/sync.py``) resolves the engines (``resolve_engine``), calls ``connect``
once, then per sync ``begin`` on global rank 0 once the engines are paused, ``send`` for each
of the stage's buckets and ``finish_stage`` on the stage's sending rank, and ``commit`` then
``end`` on global rank 0 after every stage has sent. Every engine call has a deadline
(``timeout_s``) and goes through the engines' wire (engine/wire.py: one kind per transport).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

from megatron_fr.engine.backends import backend_for
from megatron_fr.engine.http import EngineRequestError
from megatron_fr.engine.server_info import EngineKind, identify
from megatron_fr.engine.wire import EngineWire
from megatron_fr.weights.reshard import Bucket


@dataclass(frozen=True)
class Engine:
    """An inference server: its URL, how many ranks it has in a weight-update group (its
    tensor-parallel size) and what serves it. None: ask the server (``resolve_engine``)."""

    url: str
    tp_size: int | None = None
    kind: EngineKind | None = None
    pp_size: int = 1
    """SGLang pipeline stages; each would join the weight-update group at the same ranks."""
    dp_replicas: int = 1
    """SGLang data-parallel replicas (dp_size without DP attention), likewise."""

    @property
    def resolved(self) -> bool:
        return self.tp_size is not None and self.kind is not None

    def known_tp_size(self) -> int:
        """tp_size, which a resolved engine has; an unresolved one is refused."""
        if self.tp_size is None:
            raise ValueError(f"{self.url}: tp_size unknown (resolve the engine first)")
        return self.tp_size


def resolve_engine(engine: Engine, timeout_s: float) -> Engine:
    """Fill in what the server reports on GET /server_info (engine/server_info.py: SGLang and
    the CPU engine answer alike; any other server is refused). A tp_size given by the caller
    must equal what the server reports."""
    if engine.resolved:
        return engine
    info = identify(engine.url, timeout_s)
    if engine.tp_size is not None and engine.tp_size != info.tp_size:
        raise EngineRequestError(
            f"{engine.url}: configured with tp_size {engine.tp_size}, the server reports "
            f"tp_size {info.tp_size}"
        )
    return replace(
        engine,
        tp_size=info.tp_size,
        kind=info.kind,
        pp_size=info.pp_size,
        dp_replicas=info.dp_replicas,
    )


class WeightTransport(ABC):
    def __init__(self, engines: list[Engine], timeout_s: float):
        if not engines:
            raise ValueError("a weight transport needs at least one engine")
        self.engines, self.timeout_s = engines, timeout_s
        self.wire: EngineWire = backend_for(engines[0].kind).wire
        """The engines' wire (one run speaks to engines of one kind)."""

    @property
    def urls(self) -> list[str]:
        return [engine.url for engine in self.engines]

    def on_every_engine(self, call: Callable[[str], object]) -> None:
        """`call` for every engine's URL at once; raises the first failure after all finished."""
        with ThreadPoolExecutor(max_workers=len(self.urls)) as pool:
            futures = [pool.submit(call, url) for url in self.urls]
        for future in futures:
            future.result()

    def check_engines(self) -> None:  # noqa: B027  (optional hook)
        """Raise ValueError if the (resolved) engines cannot take this transport."""

    def group_names(self, stages: int) -> list[str]:
        """The process groups the engines join at connect (their names), for `stages`
        pipeline stages: none unless the transport broadcasts."""
        return []

    def connect(self, stage: int) -> None:  # noqa: B027  (optional hook)
        """Once, on the stage's sending rank, before the first sync."""

    @abstractmethod
    def send(self, bucket: Bucket) -> None:
        """One bucket of full HF tensors, on the stage's sending rank."""

    def finish_stage(self) -> None:  # noqa: B027  (optional hook)
        """After the stage's last bucket, on its sending rank."""

    def begin(self) -> None:  # noqa: B027  (optional hook)
        """On global rank 0, once the engines are paused, before any stage sends: open the
        engines' update session where they have one."""

    def commit(self, version: str) -> None:  # noqa: B027  (optional hook)
        """On global rank 0, after every stage has sent everything."""

    def end(self) -> None:  # noqa: B027  (optional hook)
        """On global rank 0, after commit: close what begin opened."""

    def close(self) -> None:  # noqa: B027  (optional hook)
        """On the stage's sending rank, when the run ends: release groups and threads."""

    def leave(self) -> None:  # noqa: B027  (optional hook)
        """On the stage's sending rank, when the pool changed: release this side of the groups
        without calling any engine (one may be dead or hung; the next connect destroys the
        old groups on the engines that stay)."""
