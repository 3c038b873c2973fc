#!/usr/bin/env python
"""Resolve requirements.txt (the GPU set) for the platform it names, without installing it.

    python tools/check_gpu_requirements.py [--requirements requirements.txt] [--json OUT]

pip resolves the file from wheel metadata only (`pip install --dry-run --report`, wheels only,
for CPython 3.12 on manylinux x86_64 up to glibc 2.39), so no CUDA wheel is downloaded and
no sdist is built; it runs in a throwaway virtual environment with a current pip (older pips
check Requires-Python against the running interpreter instead of the target). Then the pins
that must go together are checked in the resolved set: the versions this file pins, and
sglang's own pins (its METADATA: torch, transformers) met by what was resolved.

Exit status: 0 resolved and consistent, 1 not (the reason is printed), 3 the package index
could not be reached (nothing was checked).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import venv
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PYTHON_VERSION = "3.12"
PLATFORMS = [f"manylinux_2_{minor}_x86_64" for minor in range(17, 40)] + [
    "manylinux2014_x86_64",
    "linux_x86_64",
    "any",
]
PIP = "pip>=25"
OK, INCONSISTENT, OFFLINE = 0, 1, 3
OFFLINE_SIGNS = (
    "Could not fetch URL",
    "NewConnectionError",
    "Failed to establish",
    "No matching distribution found for pip",
)


class IndexUnreachable(RuntimeError):
    pass


def resolve(requirements: Path, workdir: Path) -> dict[str, dict]:
    """{normalised name: the report's metadata} of the resolved set."""
    env = workdir / "venv"
    venv.EnvBuilder(with_pip=True).create(env)
    python = str(env / "bin" / "python")
    upgrade = subprocess.run(
        [python, "-m", "pip", "install", "-q", "-U", PIP], capture_output=True, text=True
    )
    if upgrade.returncode:
        raise IndexUnreachable(upgrade.stderr.strip()[-500:])
    report = workdir / "report.json"
    command = [python, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet"]
    command += ["--report", str(report), "--python-version", PYTHON_VERSION]
    command += ["--implementation", "cp", "--only-binary=:all:", "-r", str(requirements)]
    for platform in PLATFORMS:
        command += ["--platform", platform]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode:
        if any(sign in result.stderr for sign in OFFLINE_SIGNS[:3]):
            raise IndexUnreachable(result.stderr.strip()[-500:])
        raise ValueError(f"pip could not resolve {requirements}:\n{result.stderr.strip()[-2000:]}")
    installs = json.loads(report.read_text())["install"]
    return {_norm(item["metadata"]["name"]): item["metadata"] for item in installs}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pinned(requirements: Path) -> dict[str, str]:
    """name -> version of every `name==version` line."""
    pins = {}
    for line in requirements.read_text().splitlines():
        match = re.match(r"^\s*([A-Za-z0-9_.\-]+)(?:\[[^\]]*\])?\s*==\s*([^\s;#]+)", line)
        if match:
            pins[_norm(match.group(1))] = match.group(2)
    return pins


def inconsistencies(resolved: dict[str, dict], pins: dict[str, str]) -> list[str]:
    """What does not go together: a pin of ours not resolved as pinned, or one of sglang's own
    `name==version` requirements (unconditional ones) met by another version."""
    problems = [
        f"{name}=={version} pinned, resolved {resolved.get(name, {}).get('version')}"
        for name, version in pins.items()
        if resolved.get(name, {}).get("version") != version
    ]
    for requirement in resolved.get("sglang", {}).get("requires_dist", []):
        match = re.match(r"^([A-Za-z0-9_.\-]+)(?:\[[^\]]*\])?\s*==\s*([^\s;]+)\s*$", requirement)
        if match and resolved.get(_norm(match.group(1)), {}).get("version") != match.group(2):
            found = resolved.get(_norm(match.group(1)), {}).get("version")
            problems.append(f"sglang requires {requirement}, resolved {found}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requirements", type=Path, default=REPO / "requirements.txt")
    parser.add_argument("--json", type=Path, help="write the resolved name -> version here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as workdir:
        try:
            resolved = resolve(args.requirements, Path(workdir))
        except IndexUnreachable as error:
            print(f"check_gpu_requirements: package index unreachable: {error}", file=sys.stderr)
            return OFFLINE
        except ValueError as error:
            print(f"check_gpu_requirements: {error}", file=sys.stderr)
            return INCONSISTENT
    versions = {name: meta["version"] for name, meta in sorted(resolved.items())}
    if args.json:
        args.json.write_text(json.dumps(versions, indent=2) + "\n")
    problems = inconsistencies(resolved, pinned(args.requirements))
    for problem in problems:
        print(f"check_gpu_requirements: {problem}", file=sys.stderr)
    shown = (
        "torch",
        "sglang",
        "transformers",
        "megatron-core",
        "nvidia-nccl-cu13",
        "nvidia-cuda-runtime",
        "flashinfer-python",
        "sglang-kernel",
    )
    print(
        f"{len(versions)} packages resolve together for CPython {PYTHON_VERSION} on "
        f"manylinux x86_64: " + ", ".join(f"{n} {versions.get(n)}" for n in shown)
    )
    return INCONSISTENT if problems else OK


if __name__ == "__main__":
    sys.exit(main())
