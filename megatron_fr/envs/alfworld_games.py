"""Real ALFWorld games from small PDDL problems: the bundled ones run offline.

An ALFWorld game is a folder holding traj_data.json (the ALFRED task: task_type, pddl_params,
annotations) and game.tw-pddl (JSON: ALFWorld's PDDL domain, its text grammar with the task
description filled in, the problem, "solvable"). ALFWorld ships the domain (alfred.pddl) and
the grammar (alfred.twl2) in its package but not the games, which users download
(`alfworld-download`). data/alfworld/ holds a few hand-written problems in ALFWorld's own
format (ALFRED object ids, its domain's predicates and goals); `ensure_alfworld_game` turns
one into a game folder in a cache laid out like ALFWorld's data, so alfworld's own
AlfredTWEnv collects and plays them too (the tests check that).

Importing alfworld creates $ALFWORLD_DATA (default ~/.cache/alfworld): it is pointed at the
cache first, unless the user set it.
"""

from __future__ import annotations

import json
import os
import random
import tempfile
from pathlib import Path
from typing import Any

from megatron_fr.envs.datasets import DATA_DIR

PROBLEMS_DIR = DATA_DIR / "alfworld"


def default_cache_dir() -> Path:
    return Path(tempfile.gettempdir()) / "megatron-fr-alfworld"


def import_alfworld(cache_dir: str | Path | None = None) -> Any:
    """The alfworld package, with $ALFWORLD_DATA defaulting to the cache (not the home)."""
    os.environ.setdefault("ALFWORLD_DATA", str(Path(cache_dir or default_cache_dir()) / "data"))
    try:
        import alfworld.agents.environment.alfred_tw_env as alfred_tw_env
    except ImportError as error:
        raise ImportError(
            "ALFWorld games need the alfworld package (pip install alfworld==0.4.2)"
        ) from error
    return alfred_tw_env


def alfworld_wrappers(cache_dir: str | Path | None = None) -> list[Any]:
    """The TextWorld wrappers AlfredTWEnv plays its games with: ALFRED ids -> "apple 1"."""
    alfred_tw_env = import_alfworld(cache_dir)
    return [alfred_tw_env.AlfredDemangler(shuffle=False), alfred_tw_env.AlfredInfos]


def ensure_alfworld_game(problem: str, cache_dir: str | Path | None = None) -> Path:
    """game.tw-pddl of the bundled problem `problem` (a folder of data/alfworld/), built
    into `<cache>/<problem>/` if missing (written to a temporary name, then renamed)."""
    source = PROBLEMS_DIR / problem
    if not (source / "problem.pddl").exists():
        known = sorted(p.name for p in PROBLEMS_DIR.iterdir() if p.is_dir())
        raise ValueError(f"no bundled ALFWorld problem {problem!r}; have {known}")
    target = Path(cache_dir or default_cache_dir()) / problem
    game_file = target / "game.tw-pddl"
    if game_file.exists():
        return game_file
    target.mkdir(parents=True, exist_ok=True)
    import_alfworld(cache_dir)
    from alfworld.agents.utils.misc import add_task_to_grammar
    from alfworld.info import ALFRED_PDDL_PATH, ALFRED_TWL2_PATH

    traj_data = json.loads((source / "traj_data.json").read_text())
    grammar = add_task_to_grammar(
        Path(ALFRED_TWL2_PATH).read_text(),
        traj_data,
        goal_desc_human_anns_prob=1.0,  # the annotation bundled with the problem
        rng=random.Random(0),
    )
    game = {
        "pddl_domain": Path(ALFRED_PDDL_PATH).read_text(),
        "grammar": grammar,
        "pddl_problem": (source / "problem.pddl").read_text(),
        "solvable": True,
    }
    (target / "traj_data.json").write_text(json.dumps(traj_data))
    partial = target / f".game.tw-pddl.{os.getpid()}"
    partial.write_text(json.dumps(game))
    os.replace(partial, game_file)
    return game_file
