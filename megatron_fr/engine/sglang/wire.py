"""SGLang's side of the engine interface (engine/wire.py), which the CPU engine speaks too: the
request bodies and parsing are protocol.py's, the control and weight-update calls its routes."""

from __future__ import annotations

from pathlib import Path

from megatron_fr.engine import http
from megatron_fr.engine.sglang import protocol
from megatron_fr.engine.sglang import source as src
from megatron_fr.engine.types import GenerateOutput, PauseMode, SamplingParams, TensorSerializer

FLATTENED = "flattened_bucket"
"""SGLang's load_format of a bucket broadcast as one uint8 buffer (FlattenedTensorBucket)."""


class SGLangWire:
    kind = "sglang"
    generate_path = protocol.GENERATE_PATH
    version_path = http.MODEL_INFO_PATH

    def generate_request(
        self,
        input_ids: list[int],
        sampling: SamplingParams,
        *,
        rid: str | None = None,
        routed_experts_start_len: int | None = None,
        top_logprobs_num: int = 0,
    ) -> dict[str, object]:
        return protocol.generate_request(
            input_ids,
            sampling,
            rid=rid,
            routed_experts_start_len=routed_experts_start_len,
            top_logprobs_num=top_logprobs_num,
        )

    def parse_generate(self, body: object, top_logprobs_num: int = 0) -> GenerateOutput:
        return protocol.parse_generate_response(body, top_logprobs_num)

    def pause(self, url: str, mode: PauseMode, timeout_s: float) -> None:
        body = protocol.pause_generation_request(mode)
        http.post_json(url, protocol.PAUSE_GENERATION_PATH, body, timeout_s)

    def resume(self, url: str, timeout_s: float) -> None:
        body = protocol.continue_generation_request()
        http.post_json(url, protocol.CONTINUE_GENERATION_PATH, body, timeout_s)

    def set_version(self, url: str, version: str, timeout_s: float) -> None:
        body = protocol.update_weight_version_request(version)
        http.post_json(url, protocol.UPDATE_WEIGHT_VERSION_PATH, body, timeout_s)

    def flush_cache(self, url: str, timeout_s: float) -> None:
        http.flush_cache(url, timeout_s)

    join_group_path = protocol.INIT_WEIGHTS_UPDATE_GROUP_PATH
    receive_path = protocol.UPDATE_WEIGHTS_FROM_DISTRIBUTED_PATH
    leave_group_path = protocol.DESTROY_WEIGHTS_UPDATE_GROUP_PATH
    tensor_path = protocol.UPDATE_WEIGHTS_FROM_TENSOR_PATH
    readback_families: tuple[str, ...] = protocol.WEIGHT_READBACK_FAMILIES

    def join_group_request(
        self,
        address: str,
        port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
        timeout_s: float,
    ) -> dict[str, object]:
        return protocol.init_weights_update_group_request(
            address, port, rank_offset, world_size, group_name, backend
        )

    def receive_request(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str,
        flattened: bool,
    ) -> dict[str, object]:
        return protocol.update_weights_from_distributed_request(
            names,
            dtypes,
            shapes,
            group_name=group_name,
            flush_cache=False,  # the sync flushes once, after the last stage (weights/sync.py)
            load_format=FLATTENED if flattened else None,
        )

    def leave_group_request(self, group_name: str) -> dict[str, object]:
        return protocol.destroy_weights_update_group_request(group_name)

    def tensor_request(self, payloads: list[str]) -> dict[str, object]:
        return protocol.update_weights_from_tensor_request(payloads, flush_cache=False)

    def tensor_serializer(self) -> TensorSerializer:
        """SGLang's MultiprocessingSerializer.serialize (ForkingPickler, base64) after SGLang's
        monkey_patch_torch_reductions, so each CUDA IPC handle names its GPU by UUID
        (weights/transports/tensor.py); both read from the installed sglang package where it
        cannot be imported."""
        import torch  # the weight transports' side only, not the rollout's

        if not torch.cuda.is_available():
            raise RuntimeError(
                "the tensor transport hands over CUDA IPC handles, and this machine has no "
                "CUDA: use the distributed or disk transport"
            )
        try:
            src.monkey_patch_torch_reductions()()
            serialize = src.serialize()
        except (src.SglangSourceMissing, OSError, SyntaxError) as error:
            raise RuntimeError(
                f"the tensor transport serializes with SGLang's own code, which is missing "
                f"here ({error}); use the distributed or disk transport"
            ) from error
        return lambda bucket: serialize(bucket, output_str=True)

    def begin_update(self, url: str, timeout_s: float) -> None:
        """SGLang accepts /update_weights_from_distributed and _from_tensor only between
        /begin_weight_update and /end_weight_update (the CPU engine likewise)."""
        body = protocol.begin_weight_update_request()
        http.post_json(url, protocol.BEGIN_WEIGHT_UPDATE_PATH, body, timeout_s)

    def commit_update(self, url: str, version: str, timeout_s: float) -> None:
        """SGLang applies each broadcast as it comes; the sync labels the version."""

    def end_update(self, url: str, timeout_s: float) -> None:
        body = protocol.end_weight_update_request()
        http.post_json(url, protocol.END_WEIGHT_UPDATE_PATH, body, timeout_s)

    def reload_from_disk(self, url: str, directory: Path, version: str, timeout_s: float) -> None:
        body = protocol.update_weights_from_disk_request(
            str(directory), weight_version=version, flush_cache=False
        )
        http.post_json(url, protocol.UPDATE_WEIGHTS_FROM_DISK_PATH, body, timeout_s)

    def read_weights(self, url: str, name: str, count: int, timeout_s: float) -> object:
        body = protocol.get_weights_by_name_request(name, count)
        return http.post_json(url, protocol.GET_WEIGHTS_BY_NAME_PATH, body, timeout_s)

    def release(
        self, url: str, groups: list[str], session: bool, mode: PauseMode, timeout_s: float
    ) -> None:
        if session:
            self.pause(url, mode, timeout_s)
            end = protocol.end_weight_update_request()
            _unless_absent(url, protocol.END_WEIGHT_UPDATE_PATH, end, timeout_s)
        for name in groups:  # no lock: the scheduler runs it between batches
            body = protocol.destroy_weights_update_group_request(name)
            _unless_absent(url, protocol.DESTROY_WEIGHTS_UPDATE_GROUP_PATH, body, timeout_s)


def _unless_absent(url: str, path: str, body: dict[str, object], timeout_s: float) -> None:
    """POST, where a 400 answer means there was nothing to end or destroy (SGLang and the CPU
    engine answer so for no session open and an unknown group)."""
    try:
        http.post_json(url, path, body, timeout_s)
    except http.EngineRequestError as error:
        if error.status != 400:
            raise


SGLANG_WIRE = SGLangWire()
