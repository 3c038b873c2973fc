"""The "alfworld" environment: ALFWorld's text-game interface, on two kinds of games.

    start(sample) ─► the game's intro (task + first room) and its admissible actions
    step(text)    ─► one command (the text after the last "Action:", else its last line)
                     ─► the game's feedback + the admissible actions now; reward 1.0 on a win;
                     done when the game is won or lost

Games (chosen by the sample):
- real ALFWorld games (.tw-pddl: ALFWorld's PDDL domain and grammar, played through TextWorld's
  PDDL engine with the wrappers alfworld's AlfredTWEnv uses): {"alfworld_problem": <a bundled
  hand-written problem, data/alfworld/>} offline, or {"game_file": ".../game.tw-pddl"} from
  the ALFWorld data users download (`alfworld-download`; see alfworld_samples);
- TextWorld games generated locally with the `textworld` package: {<GameSpec fields>}
  (data/textworld.jsonl, textworld_games.py), or {"game_file": "....z8"}.

The games run in-process (jericho's Z-machine, or fast-downward for PDDL): the environment
serialises game calls with one lock, so concurrent episodes are safe (a step takes 0.02-0.3 s).
"""

from __future__ import annotations

import os
import re
import threading
from pathlib import Path
from typing import Any, ClassVar

from pydantic import BaseModel, PositiveInt

from megatron_fr.config.base import StrictModel
from megatron_fr.config.tasks import AgentConfig
from megatron_fr.envs.alfworld_games import alfworld_wrappers, ensure_alfworld_game
from megatron_fr.envs.base import Environment, Episode, Sample, StepResult
from megatron_fr.envs.textworld_games import GameSpec, ensure_game

DEFAULT_SYSTEM = (
    "You are an agent in a text-based world. Each turn, reply with exactly one action, "
    "chosen from the admissible actions, on a line of the form 'Action: <action>'."
)
_ACTION = re.compile(r"action\s*:\s*(.+)", re.IGNORECASE)
_NOT_ALLOWED = re.compile(r"[^A-Za-z0-9 ,.'-]")


class AlfWorldConfig(StrictModel):
    games_dir: str | None = None
    """Cache of generated TextWorld games (None: <tmp>/megatron-fr-textworld)."""
    alfworld_dir: str | None = None
    """Cache of ALFWorld games built from bundled problems (None: <tmp>/megatron-fr-alfworld)."""
    data_root: str | None = None
    """Where a sample's relative `game_file` lives (ALFWorld's download; None: $ALFWORLD_DATA,
    else the working directory)."""
    system_prompt: str = DEFAULT_SYSTEM
    list_admissible: bool = True
    """Append the admissible actions to every observation (as ALFWorld agents are prompted)."""
    max_action_chars: PositiveInt = 200


def parse_action(text: str, limit: int = 200) -> str:
    """The command a turn gives: after the last "Action:", else its last non-empty line;
    letters, digits, spaces and ,.'- only (TextWorld's Z-machine interpreter, jericho,
    crashes the process on some control characters, measured with 0x0f, and loops forever on
    a line it reads as one of its own backslash commands), lower case, one space between
    words, without trailing punctuation."""
    found = _ACTION.findall(text)
    if found:
        command = found[-1]
    else:
        lines = [line for line in text.splitlines() if line.strip()]
        command = lines[-1] if lines else ""
    command = _NOT_ALLOWED.sub(" ", command)
    command = command.strip().strip("'").rstrip(".,")
    return " ".join(command.lower().split())[:limit]


def _task(feedback: str) -> str | None:
    """ALFWorld states its task in the intro ("Your task is to: put an apple in countertop.")."""
    match = re.search(r"Your task is to: (.+)", feedback)
    return match.group(1).strip() if match else None


def _clean(feedback: str, objective: str | None) -> str:
    """Feedback without the ASCII-art banner of a generated TextWorld game (its intro starts
    at the objective when one is given)."""
    if objective and objective in feedback:
        feedback = feedback[feedback.index(objective) :]
    return re.sub(r"\n{3,}", "\n\n", feedback).strip()


class AlfWorldEpisode(Episode):
    def __init__(self, env: AlfWorldEnvironment, game_file: Path) -> None:
        import textworld

        self._env = env
        infos = textworld.EnvInfos(
            admissible_commands=True,
            won=True,
            lost=True,
            score=True,
            max_score=True,
            objective=True,
            feedback=True,
            policy_commands=True,
        )
        alfworld = game_file.suffix == ".tw-pddl"
        wrappers = alfworld_wrappers(env.config.alfworld_dir) if alfworld else []
        with env.lock:
            self._game = textworld.start(str(game_file), request_infos=infos, wrappers=wrappers)
            state = self._game.reset()
        self.objective: str = state.objective or _task(state.feedback) or ""
        self.walkthrough: list[str] = list(state.policy_commands or [])
        """A winning command sequence from the start (for scripted policies and checks)."""
        banner_until = None if alfworld else self.objective  # ALFWorld's intro is kept whole
        intro = self._observation(_clean(state.feedback, banner_until), state)
        self.messages = [
            {"role": "system", "content": env.config.system_prompt},
            {"role": "user", "content": intro},
        ]

    def _observation(self, text: str, state: Any) -> str:
        if not self._env.config.list_admissible:
            return text
        actions = ", ".join(state.admissible_commands or [])
        return f"{text}\n\nYour admissible actions are: {actions}"

    def step(self, action: str) -> StepResult:
        command = parse_action(action, self._env.config.max_action_chars)
        if not command:
            text = "Nothing happens. (Reply with 'Action: <one admissible action>'.)"
            return StepResult(messages=[{"role": "user", "content": text}], info={"command": ""})
        with self._env.lock:
            state, _score, done = self._game.step(command)
        info = {"command": command, "won": bool(state.won), "lost": bool(state.lost)}
        if done:
            return StepResult(reward=1.0 if state.won else 0.0, done=True, info=info)
        text = self._observation(_clean(state.feedback, None), state)
        return StepResult(messages=[{"role": "user", "content": text}], info=info)

    def close(self) -> None:
        with self._env.lock:
            self._game.close()


class AlfWorldEnvironment(Environment):
    """Samples: {"id", "alfworld_problem"}, {"id", "game_file"} or {"id", <GameSpec fields>}."""

    name: ClassVar[str] = "alfworld"
    Config: ClassVar[type[BaseModel]] = AlfWorldConfig
    agent: ClassVar[AgentConfig | None] = AgentConfig(max_turns=50)

    def __init__(self, config: AlfWorldConfig | None = None) -> None:
        self.config = config or AlfWorldConfig()
        self.lock = threading.Lock()

    def game_file(self, sample: Sample) -> Path:
        """The sample's game, generated into the cache first if it is a spec."""
        if "game_file" in sample:
            root = self.config.data_root or os.environ.get("ALFWORLD_DATA", ".")
            return Path(root).expanduser() / sample["game_file"]  # absolute paths stay
        if "alfworld_problem" in sample:
            return ensure_alfworld_game(sample["alfworld_problem"], self.config.alfworld_dir)
        return ensure_game(GameSpec(**sample), self.config.games_dir)

    def start(self, sample: Sample) -> AlfWorldEpisode:
        return AlfWorldEpisode(self, self.game_file(sample))


class TextWorldEnvironment(AlfWorldEnvironment):
    """TextWorld games (specs generated offline with tw-make, or game files) played through
    the same interface; shorter episodes by default."""

    name: ClassVar[str] = "textworld"
    agent: ClassVar[AgentConfig | None] = AgentConfig(max_turns=20)


def alfworld_samples(
    data_path: str | Path, task_types: tuple[int, ...] = (1, 2, 3, 4, 5, 6)
) -> list[dict[str, str]]:
    """Samples for the ALFWorld games under `data_path` (e.g. $ALFWORLD_DATA/json_2.1.1/train
    after `alfworld-download`), found by alfworld's own AlfredTWEnv rules (traj_data.json +
    a solvable game.tw-pddl, of the given ALFRED task types)."""
    from megatron_fr.envs.alfworld_games import import_alfworld

    alfred_tw_env = import_alfworld()
    config = {
        "dataset": {"eval_id_data_path": str(data_path), "num_eval_games": -1},
        "env": {"goal_desc_human_anns_prob": 0.0, "task_types": list(task_types)},
    }
    found = alfred_tw_env.AlfredTWEnv(config, train_eval="eval_in_distribution").game_files
    root = Path(data_path)
    return [
        {"id": str(Path(path).parent.relative_to(root)), "game_file": str(path)}
        for path in sorted(found)
    ]
