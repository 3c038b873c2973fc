"""TextWorld games made locally from small specs, cached on disk: the offline stand-in for the
ALFWorld game data (which users download themselves).

A spec is {"world_size", "nb_objects", "quest_length", "seed"} (tw-make custom's knobs); the
same spec always yields the same game. `ensure_game` generates it once (2-4 s; the .z8 is
~400 KB, so games are made at run time, not committed) into `<cache>/<name>/`, building in a
private directory and renaming it into place, so concurrent callers never see half a game.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, PositiveInt


class GameSpec(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    world_size: PositiveInt = Field(default=3, le=20)
    """Rooms."""
    nb_objects: PositiveInt = 5
    quest_length: PositiveInt = Field(default=2, le=10)
    """Commands of the shortest winning walkthrough."""
    seed: NonNegativeInt = 0

    @property
    def name(self) -> str:
        return f"tw-r{self.world_size}-o{self.nb_objects}-q{self.quest_length}-s{self.seed}"


def default_cache_dir() -> Path:
    return Path(tempfile.gettempdir()) / "megatron-fr-textworld"


def ensure_game(spec: GameSpec, cache_dir: str | Path | None = None) -> Path:
    """Path of the spec's .z8 game (its .json sits beside it), generating it if missing."""
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    target = cache / spec.name
    game_file = target / "game.z8"
    if game_file.exists():
        return game_file
    cache.mkdir(parents=True, exist_ok=True)
    build = Path(tempfile.mkdtemp(prefix=f".{spec.name}-", dir=cache))
    try:
        _generate(spec, build / "game.z8")
        with contextlib.suppress(FileExistsError, OSError):
            os.rename(build, target)  # loses to a concurrent builder: theirs is the same game
    finally:
        shutil.rmtree(build, ignore_errors=True)
    if not game_file.exists():
        raise RuntimeError(f"TextWorld game {spec.name} was not generated into {target}")
    return game_file


def _generate(spec: GameSpec, path: Path) -> None:
    import textworld

    options = textworld.GameOptions()
    options.nb_rooms = spec.world_size
    options.nb_objects = spec.nb_objects
    options.quest_length = spec.quest_length
    options.seeds = spec.seed
    options.path = str(path)
    textworld.make(options)
