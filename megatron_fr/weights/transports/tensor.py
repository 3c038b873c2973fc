"""Colocated transport: CUDA IPC handles through SGLang's /update_weights_from_tensor."""

from __future__ import annotations

from collections.abc import Callable

from megatron_fr.engine import protocol
from megatron_fr.engine.http import post_json
from megatron_fr.weights.reshard import Bucket
from megatron_fr.weights.transports.base import Engine, WeightTransport

Serializer = Callable[[Bucket], str]


def sglang_serializer() -> Serializer:
    """SGLang's MultiprocessingSerializer (CUDA IPC handles, base64): needs an importable
    SGLang, so a CUDA machine."""
    try:
        from sglang.srt.utils import MultiprocessingSerializer
    except Exception as error:  # an incomplete SGLang install fails in many ways
        raise RuntimeError(
            "the tensor transport needs an importable SGLang (a CUDA machine); use the "
            "distributed or disk transport here"
        ) from error
    return lambda bucket: MultiprocessingSerializer.serialize(bucket, output_str=True)


class TensorTransport(WeightTransport):
    """Colocated engines (same GPUs as the learner): tensors are handed over as CUDA IPC
    handles through SGLang's /update_weights_from_tensor. SGLang's TP rank r deserializes
    only payload r (BaseTpWorker.deserialize_own_rank), and a payload must not be opened by
    two ranks (the producer's IPC reference counts), so each TP rank gets a serialization of
    its own: ``tp_size`` payloads per engine."""

    needs_session = True

    def __init__(
        self, engines: list[Engine], timeout_s: float, serialize: Serializer | None = None
    ):
        super().__init__(engines, timeout_s)
        self._serialize = serialize

    def request_body(self, bucket: Bucket, engine: Engine) -> dict[str, object]:
        if not engine.tp_size:
            raise ValueError(f"{engine.url}: tp_size unknown (resolve the engine first)")
        serialize = self._serialize or sglang_serializer()
        payloads = [serialize(bucket) for _ in range(engine.tp_size)]
        return protocol.update_weights_from_tensor_request(payloads, flush_cache=False)

    def send(self, bucket: Bucket) -> None:
        for engine in self.engines:
            body = self.request_body(bucket, engine)
            post_json(engine.url, protocol.UPDATE_WEIGHTS_FROM_TENSOR_PATH, body, self.timeout_s)
