"""Agent environments and their rewards, chosen by name (registry.ENVIRONMENTS).

  base.py         the interface: Environment.start(sample) -> Episode; Episode.step(action)
  registry.py     ENVIRONMENTS / CONFIGS by name, build_environment
  math_env.py     "math": one turn, the answer graded by math_grader (math-verify, deadline)
  python_tool.py  "python_tool": Qwen-style tool calls run in the sandbox, then a graded answer
  alfworld.py     "alfworld": ALFWorld's text-game interface over real ALFWorld games
                  (alfworld_games.py: bundled hand-written PDDL problems, or downloaded data)
                  and over TextWorld games generated locally (textworld_games.py)
  sandbox.py      the process sandbox for model-written code (sandbox_boot/sandbox_runner run
                  inside it)
  datasets.py     prompt files (JSONL / parquet) and the bundled samples in data/

Kept free of imports so that worker processes (math_grader) start light.
"""
