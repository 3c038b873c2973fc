"""Push the learner's weights to the inference engines after an optimizer step.

Protocol, run by every learner rank together (the resharding gathers are collectives):
  1. rank 0 pauses every engine (/pause_generation; mode "abort" ends in-flight requests,
     which the rollout client continues under the new version) and, for the broadcast and
     tensor transports, opens SGLang's weight-update session (/begin_weight_update);
  2. every stage streams its buckets; the stage's sending rank (TP 0, DP 0) hands each to
     the transport;
  3. rank 0 commits (disk: reload), closes the session (/end_weight_update), sets the new
     weight version, optionally reads a few
     tensors back and compares them bitwise, and resumes generation (/continue_generation).
Every engine call has a deadline. If any step fails the error names the engine and step and
the engines stay paused: they hold weights from two versions, and serving them would put
mixed-version tokens into training data.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_fr.config.weights import WeightSyncConfig
from megatron_fr.engine import protocol
from megatron_fr.engine.http import EngineRequestError, post_all, post_json
from megatron_fr.models.hf_config import HFModelSpec
from megatron_fr.weights.reshard import iter_hf_buckets
from megatron_fr.weights.transports import Engine, WeightTransport, build_transport


class WeightSyncError(RuntimeError):
    pass


@dataclass(frozen=True)
class SyncReport:
    version: str
    buckets: int
    tensors: int
    bytes: int
    seconds: float
    spot_checked: int


def is_stage_sender() -> bool:
    """The one rank per pipeline stage that hands the stage's tensors to the transport."""
    from megatron.core import parallel_state as ps

    return (
        ps.get_tensor_model_parallel_rank() == 0
        and ps.get_data_parallel_rank(with_context_parallel=True) == 0
    )


class WeightSync:
    def __init__(
        self,
        transport: WeightTransport,
        spec: HFModelSpec,
        *,
        bucket_bytes: int = 512 * 2**20,
        pause_mode: str = "abort",
        timeout_s: float = 60.0,
        spot_check: int = 0,
    ):
        self.transport, self.spec = transport, spec
        self.bucket_bytes, self.pause_mode = bucket_bytes, pause_mode
        self.timeout_s, self.spot_check = timeout_s, spot_check

    @classmethod
    def from_config(cls, config: WeightSyncConfig, engines: list[Engine], spec: HFModelSpec):
        return cls(
            build_transport(config, engines),
            spec,
            bucket_bytes=config.bucket_mib * 2**20,
            pause_mode=config.pause_mode,
            timeout_s=config.timeout_s,
            spot_check=config.spot_check,
        )

    def connect(self) -> None:
        """Once per run, on every learner rank (only stage senders talk to the engines)."""
        from megatron.core import parallel_state as ps

        stage = ps.get_pipeline_model_parallel_rank()
        failure = self._attempt(is_stage_sender(), "connect", lambda: self.transport.connect(stage))
        _raise_if_any(failure)

    def sync(self, model: torch.nn.Module, version: str | int) -> SyncReport:
        """Every learner rank calls this; all of them return, or all raise WeightSyncError."""
        version, started = str(version), time.monotonic()
        rank0, sender = dist.get_rank() == 0, is_stage_sender()
        failure = self._attempt(rank0, "pause", self._pause)
        _raise_if_any(failure)
        buckets = tensors = nbytes = 0
        kept: list[tuple[str, torch.Tensor]] = []
        for bucket in iter_hf_buckets(model, self.spec, self.bucket_bytes):
            # After a failure the sender stops sending but keeps iterating: the resharding
            # gathers are collectives its peers are waiting in.
            if sender and failure is None:
                failure = self._attempt(True, "send", lambda b=bucket: self.transport.send(b))
                keep = self.spot_check - len(kept)
                kept += [(n, t.flatten()[:8].clone()) for n, t in bucket[: max(keep, 0)]]
            buckets, tensors = buckets + 1, tensors + len(bucket)
            nbytes += sum(t.numel() * t.element_size() for _, t in bucket)
            del bucket  # else it stays alive while the next one is built: two buckets' memory
        if failure is None:
            failure = self._attempt(sender, "finish", self.transport.finish_stage)
        _raise_if_any(failure)
        failure = self._attempt(rank0, "commit", lambda: self._commit(version, kept))
        _raise_if_any(failure)
        return SyncReport(version, buckets, tensors, nbytes, time.monotonic() - started, len(kept))

    def _pause(self) -> None:
        self._post_all(
            protocol.PAUSE_GENERATION_PATH, protocol.pause_generation_request(self.pause_mode)
        )
        if self.transport.needs_session:
            self._post_all(
                protocol.BEGIN_WEIGHT_UPDATE_PATH, protocol.begin_weight_update_request()
            )

    def _commit(self, version: str, kept: list[tuple[str, torch.Tensor]]) -> None:
        self.transport.commit(version)
        if self.transport.needs_session:
            self._post_all(protocol.END_WEIGHT_UPDATE_PATH, protocol.end_weight_update_request())
        self._post_all(
            protocol.UPDATE_WEIGHT_VERSION_PATH, protocol.update_weight_version_request(version)
        )
        self._check(kept)
        self._post_all(protocol.CONTINUE_GENERATION_PATH, protocol.continue_generation_request())

    def _post_all(self, path: str, body: dict) -> None:
        post_all(self.transport.urls, path, body, self.timeout_s)

    @staticmethod
    def _attempt(this_rank: bool, what: str, call) -> str | None:
        """Run call on the ranks it concerns; the failure as a message (None if it worked)."""
        if not this_rank:
            return None
        try:
            call()
        except (EngineRequestError, WeightSyncError, RuntimeError, TimeoutError) as error:
            return f"rank {dist.get_rank()} at {what}: {error}"
        return None

    def _check(self, kept: list[tuple[str, torch.Tensor]]) -> None:
        """Read the first values of a few sent tensors back from every engine, bitwise."""
        for name, expected in kept:
            for url in self.transport.urls:
                body = {"name": name, "truncate_size": expected.numel()}
                served = post_json(url, "/get_weights_by_name", body, self.timeout_s)
                if torch.tensor(served, dtype=torch.float32).tolist() != expected.float().tolist():
                    raise WeightSyncError(
                        f"spot check: {url} serves {name} = {served}, sent {expected.tolist()}"
                    )


def _raise_if_any(failure: str | None) -> None:
    """A sync point of all learner ranks: every rank raises if any rank failed."""
    failures = [None] * dist.get_world_size()
    dist.all_gather_object(failures, failure)
    messages = [message for message in failures if message]
    if messages:
        raise WeightSyncError("weight sync failed: " + "; ".join(messages))
