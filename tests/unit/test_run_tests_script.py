"""tools/run_tests.sh's exit trap, run by bash under the script's own `set -euo pipefail`.

The trap stops the background vLLM install when the suite fails early. Under errexit a failing
command inside the trap ends the script with that command's status, so a trap whose `pkill`
finds nothing to stop (the install finished long ago) turned a fully passing run into exit 1.
And the install must be stopped before its child is killed: otherwise it runs its next command
in the moment between its child's end and its own (on a busy machine the failing case below
saw its marker written in 3 of 5 runs with a trap that killed the child first).
"""

import re
import subprocess
import time
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "run_tests.sh"


def _exit_trap_line() -> str:
    lines = [line for line in SCRIPT.read_text().splitlines() if re.match(r"trap .* EXIT$", line)]
    assert len(lines) == 1, f"expected one EXIT trap in {SCRIPT}, found {lines}"
    return lines[0]


def _run_with_the_trap(background: str, body: str, tmp_path: Path) -> subprocess.CompletedProcess:
    """The script's prologue, its background install replaced by `background`, then `body`."""
    script = "\n".join(
        [
            "set -euo pipefail",
            f"vllm_log={tmp_path / 'vllm.log'}",
            "touch $vllm_log",
            f"{background} &",
            "vllm_setup=$!",
            _exit_trap_line(),
            body,
        ]
    )
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30)


def test_a_passing_run_exits_0_after_the_install_has_finished(tmp_path):
    done = _run_with_the_trap("true", 'wait "$vllm_setup"\ntrue', tmp_path)
    assert done.returncode == 0, done.stderr
    assert not (tmp_path / "vllm.log").exists()


def test_a_failing_run_keeps_its_exit_code_and_stops_the_install(tmp_path):
    marker = tmp_path / "install-still-ran"
    started = time.monotonic()
    done = _run_with_the_trap(f"bash -c 'sleep 2; touch {marker}'", "exit 3", tmp_path)
    assert done.returncode == 3
    time.sleep(max(0.0, 3 - (time.monotonic() - started)))
    assert not marker.exists(), "the trap left the background install running"
