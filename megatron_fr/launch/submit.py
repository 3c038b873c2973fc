"""`slurm/launch.sh RECIPE --run-dir DIR [options] [dotted.key=value ...]`: check, render and
submit a recipe's Slurm job (or, with --dry-run, print the plan and every command instead).

    slurm/launch.sh examples/cpu_demo.yaml --run-dir runs/demo --rollout-nodes 1 \
        --learner-nodes 2 --dry-run

The batch script is written to RUN_DIR/slurm/job.sbatch and submitted with `sbatch --parsable`;
the job id is the last line printed. Exit status 2: the job was refused (the reason is
printed), nothing was submitted.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from megatron_fr.launch.slurm import (
    LaunchError,
    SlurmOptions,
    render_script,
    resolve_job,
    summary,
)

REFUSED = 2
FLAGS = {  # flag: SlurmOptions field, for every option taking a value (lists use action=append)
    name.replace("_", "-"): name
    for name in SlurmOptions.model_fields
    if name not in ("exclusive", "server_args", "env", "sbatch_args")
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="slurm/launch.sh", description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe")
    parser.add_argument("--run-dir", required=True, type=Path, help="on a shared filesystem")
    for flag, field in FLAGS.items():
        info = SlurmOptions.model_fields[field]
        parser.add_argument(f"--{flag}", dest=field, help=info.description)
    parser.add_argument("--exclusive", action="store_true", help="whole nodes (sbatch)")
    for flag, field in (
        ("server-arg", "server_args"),
        ("env", "env"),
        ("sbatch-arg", "sbatch_args"),
    ):
        help_text = (SlurmOptions.model_fields[field].description or "") + " (repeatable)"
        parser.add_argument(f"--{flag}", dest=field, action="append", default=[], help=help_text)
    parser.add_argument("--dry-run", action="store_true", help="print the plan, submit nothing")
    parser.add_argument(
        "--script-out", type=Path, help="with --dry-run: also write the batch script here"
    )
    parser.add_argument("overrides", nargs="*", help="dotted.key=value, as for megatron-fr train")
    return parser


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)  # overrides may follow the options
    unknown = [item for item in extra if "=" not in item or item.startswith("-")]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.overrides = [*args.overrides, *extra]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    given = {field: getattr(args, field) for field in FLAGS.values()}
    given = {key: value for key, value in given.items() if value is not None}
    try:
        options = SlurmOptions(
            **given,
            exclusive=args.exclusive,
            server_args=tuple(args.server_args),
            env=tuple(args.env),
            sbatch_args=tuple(args.sbatch_args),
        )
        job = resolve_job(args.recipe, args.run_dir, args.overrides, options)
    except (LaunchError, ValueError) as error:
        print(f"slurm/launch.sh: refused: {error}", file=sys.stderr)
        return REFUSED
    script = render_script(job)
    if args.dry_run:
        if args.script_out is not None:
            args.script_out.write_text(script)
        print(f"megatron-fr Slurm job (dry run: nothing submitted)\n{summary(job)}")
        print(f"sbatch    sbatch --parsable {job.run_dir}/slurm/job.sbatch")
        print("--- the job's commands (slurm/job.sh with MFR_DRY_RUN=1, nodes node1..) ---")
        return dry_run(script)
    return submit(job.run_dir, script)


def dry_run(script: str) -> int:
    """Run the rendered script with MFR_DRY_RUN=1 outside Slurm: it prints its commands."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    with tempfile.NamedTemporaryFile("w", suffix=".sbatch") as handle:
        handle.write(script)
        handle.flush()
        result = subprocess.run(["bash", handle.name], env=env | {"MFR_DRY_RUN": "1"})
    return result.returncode


def submit(run_dir: Path, script: str) -> int:
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)  # sbatch --output's directory
    path = run_dir / "slurm" / "job.sbatch"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(script)
    result = subprocess.run(["sbatch", "--parsable", str(path)], capture_output=True, text=True)
    if result.returncode:
        print(f"slurm/launch.sh: sbatch failed: {result.stderr.strip()}", file=sys.stderr)
        return result.returncode
    job_id = result.stdout.strip().split(";")[0]
    print(f"submitted {path} as job {job_id}; log: {run_dir}/logs/slurm-{job_id}.out")
    print(job_id)
    return 0


if __name__ == "__main__":
    sys.exit(main())
