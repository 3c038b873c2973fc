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
from collections.abc import Callable
from urllib.parse import urlparse

import torch

from megatron_fr.engine.http import post_json
from megatron_fr.engine.sglang import protocol
from megatron_fr.engine.sglang import source as src
from megatron_fr.utils.net import is_this_host
from megatron_fr.weights.reshard import Bucket
from megatron_fr.weights.transports.base import (
    Engine,
    WeightTransport,
    begin_sglang_session,
    end_sglang_session,
)

Serializer = Callable[[Bucket], str]


class NotColocated(RuntimeError):
    """The tensor transport was pointed at an engine on another node."""


def sglang_serializer() -> Serializer:
    """SGLang's MultiprocessingSerializer.serialize (ForkingPickler, base64) after SGLang's
    monkey_patch_torch_reductions, so each CUDA IPC handle names its GPU by UUID (module
    docstring); both read from the installed sglang package where it cannot be imported."""
    if not torch.cuda.is_available():
        raise RuntimeError(
            "the tensor transport hands over CUDA IPC handles, and this machine has no CUDA: "
            "use the distributed or disk transport"
        )
    try:
        src.monkey_patch_torch_reductions()()
        serialize = src.serialize()
    except (src.SglangSourceMissing, OSError, SyntaxError) as error:
        raise RuntimeError(
            f"the tensor transport serializes with SGLang's own code, which is missing here "
            f"({error}); use the distributed or disk transport"
        ) from error
    return lambda bucket: serialize(bucket, output_str=True)


class TensorTransport(WeightTransport):
    """Colocated engines (same GPUs as the learner): tensors are handed over as CUDA IPC
    handles through SGLang's /update_weights_from_tensor. SGLang's TP rank r deserializes
    only payload r (BaseTpWorker.deserialize_own_rank), and a payload must not be opened by
    two ranks (the producer's IPC reference counts), so each TP rank gets a serialization of
    its own: ``tp_size`` payloads per engine."""

    def begin(self) -> None:
        begin_sglang_session(self.urls, self.timeout_s)

    def end(self) -> None:
        end_sglang_session(self.urls, self.timeout_s)

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
            self._serialize = sglang_serializer()
        payloads = [self._serialize(bucket) for _ in range(tp_size)]
        return protocol.update_weights_from_tensor_request(payloads, flush_cache=False)

    def send(self, bucket: Bucket) -> None:
        for engine in self.engines:
            body = self.request_body(bucket, engine)
            post_json(engine.url, protocol.UPDATE_WEIGHTS_FROM_TENSOR_PATH, body, self.timeout_s)
