"""Colocated transport: CUDA IPC handles through SGLang's /update_weights_from_tensor."""

from __future__ import annotations

from megatron_fr.engine import protocol
from megatron_fr.engine.http import post_json
from megatron_fr.weights.reshard import Bucket
from megatron_fr.weights.transports.base import WeightTransport


class TensorTransport(WeightTransport):
    """Colocated engines (same GPUs as the learner): tensors are handed over by CUDA IPC
    handles through SGLang's /update_weights_from_tensor, one serialized list per engine TP
    rank. Needs SGLang's serializer, so it works only where SGLang itself runs (CUDA)."""

    needs_session = True

    def send(self, bucket: Bucket) -> None:
        try:
            from sglang.srt.utils import MultiprocessingSerializer
        except ImportError as error:
            raise RuntimeError(
                "the tensor transport needs an importable SGLang (a CUDA machine); use the "
                "distributed or disk transport here"
            ) from error
        for engine in self.engines:
            payload = MultiprocessingSerializer.serialize(bucket, output_str=True)
            body = protocol.update_weights_from_tensor_request(
                [payload] * engine.tp_size, flush_cache=False
            )
            post_json(engine.url, protocol.UPDATE_WEIGHTS_FROM_TENSOR_PATH, body, self.timeout_s)
