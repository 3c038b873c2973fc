"""Colocated transport: CUDA IPC handles through SGLang's /update_weights_from_tensor.

A CUDA IPC handle can be opened only by a process on the same node, on the GPU it names. Torch
names the GPU by its index, which differs between processes that see the GPUs in different
orders (CUDA_VISIBLE_DEVICES); SGLang's receiver applies ``monkey_patch_torch_reductions``
(srt/utils/patch_torch.py) so that a handle may name the GPU by its UUID instead, and this
sender applies the same patch before serializing, so its handles carry UUIDs. Engines that are
not on this node are refused when the transport connects, naming the engine.
"""

from __future__ import annotations

import socket
from urllib.parse import urlparse

from megatron_fr.engine.http import post_json
from megatron_fr.engine.types import TensorSerializer
from megatron_fr.utils.net import is_this_host
from megatron_fr.weights.reshard import Bucket
from megatron_fr.weights.transports.base import Engine, WeightTransport

Serializer = TensorSerializer


class NotColocated(RuntimeError):
    """The tensor transport was pointed at an engine on another node."""


class TensorTransport(WeightTransport):
    """Colocated engines (same GPUs as the learner): tensors are handed over as CUDA IPC
    handles through SGLang's /update_weights_from_tensor. SGLang's TP rank r deserializes
    only payload r (BaseTpWorker.deserialize_own_rank), and a payload must not be opened by
    two ranks (the producer's IPC reference counts), so each TP rank gets a serialization of
    its own: ``tp_size`` payloads per engine."""

    def begin(self) -> None:
        self.on_every_engine(lambda url: self.wire.begin_update(url, self.timeout_s))

    def end(self) -> None:
        self.on_every_engine(lambda url: self.wire.end_update(url, self.timeout_s))

    def __init__(
        self, engines: list[Engine], timeout_s: float, serialize: Serializer | None = None
    ):
        super().__init__(engines, timeout_s)
        self._serialize = serialize

    def connect(self, stage: int) -> None:
        """On the stage's sending rank: every engine must run on this node."""
        for engine in self.engines:
            host = urlparse(engine.url).hostname or ""
            if not is_this_host(host):
                raise NotColocated(
                    f"weights.transport 'tensor' hands CUDA IPC handles to {engine.url}, and "
                    f"only a process on this node ({socket.gethostname()}) can open them: "
                    f"{host!r} is not this node. Serve the engines on the learner's node, or "
                    "use weights.transport=distributed (or disk)"
                )

    def request_body(self, bucket: Bucket, engine: Engine) -> dict[str, object]:
        tp_size = engine.known_tp_size()
        if self._serialize is None:
            self._serialize = self.wire.tensor_serializer()
        payloads = [self._serialize(bucket) for _ in range(tp_size)]
        return self.wire.tensor_request(payloads)

    def send(self, bucket: Bucket) -> None:
        for engine in self.engines:
            body = self.request_body(bucket, engine)
            post_json(engine.url, self.wire.tensor_path, body, self.timeout_s)
