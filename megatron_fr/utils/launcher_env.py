"""The environment of a program a rank starts that is not a rank of its job (a converter, an
inference engine): kept free of torch, so that the HTTP-only engine launcher needs none."""

from __future__ import annotations

import os

LAUNCHER_VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "MASTER_ADDR",
    "MASTER_PORT",
)


def standalone_env() -> dict[str, str]:
    """This process's environment without torchrun's rank variables, for programs it starts
    that are not ranks of its job (a converter, an inference engine): with them, such a
    program's own torch.distributed would join the job's store and wait there forever."""
    return {
        key: value
        for key, value in os.environ.items()
        if key not in LAUNCHER_VARIABLES and not key.startswith("TORCHELASTIC_")
    }
