"""The registry of engine kinds: rollout.engine.kind -> its EngineBackend (engine/backend.py).

Adding an engine kind: its folder under engine/ with a backend.py that defines BACKEND, one
line below, and its capabilities' row in config/engine_kinds.py (checked here at import: the
two list the same kinds)."""

from __future__ import annotations

from megatron_fr.config.engine_kinds import ENGINE_KINDS
from megatron_fr.engine.backend import EngineBackend
from megatron_fr.engine.cpu.backend import BACKEND as CPU
from megatron_fr.engine.sglang.backend import BACKEND as SGLANG
from megatron_fr.engine.vllm.backend import BACKEND as VLLM

BACKENDS: dict[str, EngineBackend] = {backend.kind: backend for backend in (SGLANG, VLLM, CPU)}
if set(BACKENDS) != set(ENGINE_KINDS):
    raise ImportError(
        f"engine kinds registered {sorted(BACKENDS)} differ from config/engine_kinds.py's "
        f"{sorted(ENGINE_KINDS)}"
    )


def backend_for(kind: str | None) -> EngineBackend:
    """The backend of engines of `kind` (None: an engine not identified yet, spoken to as
    SGLang, the protocol the project's engines share); ValueError for an unknown kind."""
    if kind is None:
        return SGLANG
    if kind not in BACKENDS:
        raise ValueError(f"engine kind {kind!r}: one of {', '.join(BACKENDS)}")
    return BACKENDS[kind]
