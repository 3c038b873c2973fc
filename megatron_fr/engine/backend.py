"""One object per engine kind: how the project starts and speaks to engines of that kind.

    EngineBackend.wire               the calls a run makes of a server (engine/wire.py)
    EngineBackend.command            the argv of a server for a ServerLaunchConfig
    EngineBackend.environment        the environment it runs in
    EngineBackend.check_machine      what this machine must have to start one (named remedy)
    EngineBackend.capabilities       what it serves (config/engine_kinds.py: the recipe's
                                     check, the weight transports, the Slurm launcher)

Each kind's folder defines its object (engine/<kind>/backend.py); engine/backends.py is the
registry that finds it by rollout.engine.kind. Nothing outside those switches on a kind.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from megatron_fr.config.engine_kinds import ENGINE_KINDS, EngineCapabilities, EngineKind
from megatron_fr.engine.server_config import ServerLaunchConfig
from megatron_fr.engine.wire import EngineWire

HasCuda = Callable[[], bool]
"""Whether this machine has CUDA, asked only by a kind whose answer depends on it: asking
imports torch, seconds that a CPU engine's launcher (or `megatron-fr serve`, which then
replaces itself with the server) would spend for nothing."""
Command = Callable[[ServerLaunchConfig, HasCuda, bool], list[str]]
"""(settings, has_cuda, whether the server exits with its parent) -> argv."""
Environment = Callable[[dict[str, str], HasCuda], dict[str, str]]
"""(the launcher's environment, has_cuda) -> the server's."""
MachineCheck = Callable[[str, str, str | None, HasCuda], None]
"""(the setting that chose the kind, its remedy, the interpreter asked for, has_cuda) ->
None, or ValueError naming the setting and the remedy."""


@dataclass(frozen=True)
class EngineBackend:
    kind: EngineKind
    wire: EngineWire
    command: Command
    environment: Environment
    check_machine: MachineCheck

    @property
    def capabilities(self) -> EngineCapabilities:
        return ENGINE_KINDS[self.kind]

    @property
    def name(self) -> str:
        return self.capabilities.name

    def reads_back(self, model_type: str) -> bool:
        """Whether a synced tensor of a `model_type` model can be read back (spot_check)."""
        readback = self.capabilities.weight_readback
        listed = readback == "listed_families" and model_type in self.wire.readback_families
        return readback == "any" or listed

    def readback_refusal(self, model_type: str) -> str | None:
        """Why weights.spot_check cannot run on these engines for a `model_type` model (the
        sentence an error starts with), or None when it can."""
        if self.reads_back(model_type):
            return None
        families = self.wire.readback_families
        if self.capabilities.weight_readback == "none" or not families:
            return f"{self.name} has no route to read weights back"
        return (
            f"{self.name} does not read back the weights of {model_type} "
            f"(/get_weights_by_name exists for {', '.join(families)} only)"
        )


def check_nothing(where: str, remedy: str, python: str | None, has_cuda: HasCuda) -> None:
    """A kind that runs on any machine the project runs on."""
