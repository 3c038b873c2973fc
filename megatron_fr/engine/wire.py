"""The one interface through which the project talks to an inference engine, whatever serves it.

SGLang, vLLM and the project's CPU engine (which speaks SGLang's wire) differ in their routes
and bodies, not in what the project asks of them: generate token in / token out with the
sampled tokens' log-probs and weight versions, say which weights they serve, pause and resume
generation around a weight sync, label their weights with a version and empty their prefix
cache. EngineWire is that set; engine/sglang/wire.py and engine/vllm/wire.py implement it, and
everything past the wire (the rollout client, the pool's supervisor, the weight sync and its
probe) is written once against it. How weights move into an engine is a weight transport's
job (weights/transports/), chosen by the engines' kind; the calls a transport makes of the
engine (join a weight-update group, name the tensors the next broadcasts hold, reload from a
directory, open and close an update session) are the wire's too, so no code outside engine/
speaks an engine's own routes.

One run speaks to engines of one kind: its backend (engine/backends.py) holds the wire, chosen
by rollout.engine.kind, or by what the engines given by URL say they are (engine/server_info.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from megatron_fr.engine.types import GenerateOutput, PauseMode, SamplingParams, TensorSerializer


class EngineWire(Protocol):
    kind: str
    generate_path: str
    """POST: one prompt's generation (generate_request's body, parse_generate's answer)."""
    version_path: str
    """GET: {"weight_version": str}, the version the engine's weights carry. It runs no
    generation, so an engine paused by a long weight sync still answers it (the pool's
    liveness check)."""

    def generate_request(
        self,
        input_ids: list[int],
        sampling: SamplingParams,
        *,
        rid: str | None = None,
        routed_experts_start_len: int | None = None,
        top_logprobs_num: int = 0,
    ) -> dict[str, object]:
        """Body of generate_path: the output tokens' log-probs of the distribution sampled from;
        a request this engine cannot honour raises ValueError before anything is sent."""
        ...

    def parse_generate(self, body: object, top_logprobs_num: int = 0) -> GenerateOutput:
        """The answer of generate_path read strictly (MalformedResponse naming the field)."""
        ...

    def pause(self, url: str, mode: PauseMode, timeout_s: float) -> None:
        """Stop generating; "abort" ends requests in flight with finish_reason "abort" and the
        tokens so far (the rollout client continues them after the sync)."""
        ...

    def resume(self, url: str, timeout_s: float) -> None: ...

    def set_version(self, url: str, version: str, timeout_s: float) -> None:
        """Label the engine's weights `version` (what version_path then answers, and every
        token generated from now on carries)."""
        ...

    def flush_cache(self, url: str, timeout_s: float) -> None:
        """Empty the prefix cache, so no KV computed by older weights is reused."""
        ...

    # --- weight updates (weights/sync.py, weights/transports/) ---

    join_group_path: str
    """POST join_group_request: the engine's ranks join a weight-update group."""
    receive_path: str
    """POST receive_request: what the group's next broadcasts hold; answered once received."""
    leave_group_path: str
    """POST leave_group_request: the engine's ranks leave the group."""
    tensor_path: str
    """POST tensor_request: tensors handed over as CUDA IPC handles (colocated engines)."""
    readback_families: tuple[str, ...]
    """Model families whose weights read_weights reads back (none: the engine cannot)."""

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
        """Body of join_group_path: the engine's TP rank t joins the group hosted at
        address:port (the sender is rank 0) at rank_offset + t."""
        ...

    def receive_request(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str,
        flattened: bool,
    ) -> dict[str, object]:
        """Body of receive_path: the tensors the next broadcasts hold, in order (HF names,
        torch dtype names, shapes), one flattened buffer where `flattened`; the sync flushes
        the cache itself, once."""
        ...

    def leave_group_request(self, group_name: str) -> dict[str, object]: ...

    def tensor_request(self, payloads: list[str]) -> dict[str, object]:
        """Body of tensor_path: one serialized payload per TP rank of the engine."""
        ...

    def tensor_serializer(self) -> TensorSerializer:
        """How the tensor transport serializes a bucket for this engine (RuntimeError where it
        cannot here: no CUDA, or the engine's code missing)."""
        ...

    def begin_update(self, url: str, timeout_s: float) -> None:
        """Open the engine's update session, once it is paused and before any weights come."""
        ...

    def commit_update(self, url: str, version: str, timeout_s: float) -> None:
        """After every broadcast: apply the weights received, labelled `version`, where the
        engine applies them at the end of a session (else nothing)."""
        ...

    def end_update(self, url: str, timeout_s: float) -> None:
        """Close the session begin_update opened (where commit_update has not)."""
        ...

    def reload_from_disk(self, url: str, directory: Path, version: str, timeout_s: float) -> None:
        """Load the safetensors files of `directory` (shared with the engine) in place,
        labelled `version` where the engine labels them on loading."""
        ...

    def read_weights(self, url: str, name: str, count: int, timeout_s: float) -> object:
        """The first `count` values of tensor `name` as the engine serves it (a list)."""
        ...

    def release(
        self, url: str, groups: list[str], session: bool, mode: PauseMode, timeout_s: float
    ) -> None:
        """At connect, what a learner that died may have left on the engine: its update
        session ended (paused in `mode` first; `session` False: none can be open) and the
        weight-update `groups` left; nothing to end or leave is no error."""
        ...
