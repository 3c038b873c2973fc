"""The CPU engine's served weights and their version label, changed only between decoding steps.

Every decoding step runs inside `step()`, which holds the one lock every change of weights or
label also takes, and reads the label there: the version recorded for a token is that of the
weights that produced it. Updates are atomic with respect to a step, by two mechanisms:

- A distributed update spans several HTTP calls (/begin_weight_update, one
  /update_weights_from_distributed per bucket, /end_weight_update) and its sender can die
  between them, so its tensors are staged and swapped in at end_update in one locked section,
  together with the version the session named: decoding keeps running on the complete old
  weights meanwhile, a refused bucket discards the whole update, and a session that never ends
  changes nothing. Cost: memory for one copy of what the session sent.
- A disk load is one call, so it holds the lock across all its chunks instead (no step runs
  during it; memory stays one chunk). Names and shapes are checked against the model before
  anything is written; should reading still fail half-way, `fault` is set and every step
  raises WeightsFault (HTTP 503) until a later update completes, rather than decode with a
  mix of two versions.
"""

from __future__ import annotations

import contextlib
import re
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from megatron_fr.utils.hf_checkpoint import HFCheckpointReader

_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")

DISK_CHUNK_TENSORS = 64
"""Tensors read from disk at a time by a disk load (bounded memory on big checkpoints)."""


class RequestError(ValueError):
    """A request the engine refuses before doing any work (HTTP 400)."""


class WeightsFault(RuntimeError):
    """The weights were left half-written by a failed load; decoding is refused until a later
    update completes (HTTP 503: the client retries on another server)."""


@dataclass
class _UpdateSession:
    """Tensors staged between /begin_weight_update and /end_weight_update."""

    tensors: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    version: str | None = None
    failure: str | None = None


class ServedWeights:
    """The parameters of one live model, their version label and the updates to them."""

    def __init__(self, model: torch.nn.Module, version: str = "default"):
        self.model = model
        self.version = version
        self.fault: str | None = None
        """Why the weights are unusable (a load failed half-way), or None."""
        self._lock = threading.Lock()
        self._session_lock = threading.Lock()
        self._session: _UpdateSession | None = None

    @contextlib.contextmanager
    def step(self) -> Iterator[str]:
        """Hold the weights still for one decoding step; yields their version."""
        with self._lock, torch.no_grad():
            if self.fault is not None:
                raise WeightsFault(self.fault)
            yield self.version

    def set_version(self, version: str) -> None:
        """Relabel the served weights; inside an update session the label waits for the
        staged weights it names (applied at end_update)."""
        with self._session_lock:
            if self._session is not None:
                self._session.version = version
                return
        with self._lock:
            self.version = version

    @property
    def session_open(self) -> bool:
        with self._session_lock:
            return self._session is not None

    def begin_update(self) -> None:
        with self._session_lock:
            if self._session is not None:
                raise RequestError(
                    "a weight-update session is already open; call end_weight_update"
                )
            self._session = _UpdateSession()

    def check_update(self, shapes: list[tuple[str, list[int]]]) -> None:
        """Refuse, before a byte is received, a bucket whose names or shapes the model does not
        have, or one sent outside a session (the caller marks the session failed)."""
        if not self.session_open:
            raise RequestError(
                "update_weights_from_distributed must run between begin_weight_update() and "
                "end_weight_update()"
            )
        params = dict(self.model.named_parameters())
        try:
            for name, shape in shapes:
                _target_slice(params, name, shape)
        except (KeyError, ValueError) as error:
            raise RequestError(_message(error)) from error

    def fail_update(self, reason: str) -> None:
        """Mark the open session (if any) as failed: its end applies nothing."""
        with self._session_lock:
            if self._session is not None and self._session.failure is None:
                self._session.failure = reason

    def stage(self, tensors: list[tuple[str, torch.Tensor]], version: str | None) -> int:
        """Keep one received bucket (and the version it names) for end_update."""
        self.check_update([(name, list(tensor.shape)) for name, tensor in tensors])
        with self._session_lock:
            if self._session is None:
                raise RequestError("the weight-update session ended while a bucket arrived")
            self._session.tensors += tensors
            if version is not None:
                self._session.version = version
        return len(tensors)

    def end_update(self) -> int:
        """Swap every staged tensor (and the session's version) in at once; raise, changing
        nothing, if a bucket of the session was refused."""
        with self._session_lock:
            session, self._session = self._session, None
        if session is None:
            raise RequestError("no weight-update session is open; call begin_weight_update first")
        if session.failure is not None:
            raise RequestError(f"weight update discarded, nothing applied: {session.failure}")
        params = dict(self.model.named_parameters())
        with self._lock, torch.no_grad():
            for name, tensor in session.tensors:
                _target_slice(params, name, tensor.shape).copy_(tensor)
            if session.version is not None:
                self.version = session.version
            self.fault = None
        return len(session.tensors)

    def load_from_disk(self, model_path: str | Path, version: str | None = None) -> int:
        """Load every tensor of an HF checkpoint directory (and then the version label) with
        no decoding step in between."""
        params = dict(self.model.named_parameters())
        try:  # everything checked before anything is written
            reader = HFCheckpointReader(model_path)
            names = sorted(reader.tensors)
            for name in names:
                _target_slice(params, name, reader.tensors[name].shape)
        except Exception as error:  # a missing directory, a foreign checkpoint, a bad header
            raise RequestError(f"model_path {str(model_path)!r}: {_message(error)}") from error
        with self._lock, torch.no_grad():
            try:
                for start in range(0, len(names), DISK_CHUNK_TENSORS):
                    chunk = reader.read(names[start : start + DISK_CHUNK_TENSORS])
                    for name, tensor in chunk.items():
                        _target_slice(params, name, tensor.shape).copy_(tensor)
            except Exception as error:
                self.fault = f"loading {model_path} failed half-way ({error}); update again"
                raise WeightsFault(self.fault) from error
            if version is not None:
                self.version = version
            self.fault = None
        return len(names)

    def read(self, name: str) -> torch.Tensor:
        """A copy of one checkpoint-named tensor as served (KeyError if the model has none)."""
        with self._lock:
            return _target_slice(dict(self.model.named_parameters()), name, None).detach().clone()


def _target_slice(
    params: dict[str, torch.nn.Parameter], name: str, shape: Sequence[int] | None
) -> torch.Tensor:
    """The live tensor a checkpoint-named tensor (save_pretrained names) is written into.

    transformers keeps a MoE layer's experts fused in memory (experts.gate_up_proj [E, 2I, H]
    with gate first, experts.down_proj [E, H, I]); per-expert names map to their slices.
    Unknown names and wrong shapes raise, naming the tensor."""
    target: torch.Tensor | None = params.get(name)
    match = _EXPERT.match(name)
    if match:
        prefix, expert, which = match.group(1), int(match.group(2)), match.group(3)
        fused = params.get(f"{prefix}.{'down_proj' if which == 'down' else 'gate_up_proj'}")
        if fused is not None and expert < fused.shape[0]:
            target = fused[expert]
            if which != "down":
                half = target.shape[0] // 2
                target = target[:half] if which == "gate" else target[half:]
    if target is None:
        raise KeyError(f"{name}: no such tensor in the served model")
    if shape is not None and tuple(target.shape) != tuple(shape):
        raise ValueError(f"{name}: shape {list(shape)} sent, the model has {list(target.shape)}")
    return target


def _message(error: Exception) -> str:
    return str(error.args[0]) if isinstance(error, KeyError) and error.args else str(error)
