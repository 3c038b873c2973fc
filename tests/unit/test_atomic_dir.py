"""atomic_directory: the target appears whole or not at all, and a rerun removes the partial
output of a killed writer only when the writer is provably gone."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_fr.utils.atomic_dir import atomic_directory

REPO = Path(__file__).resolve().parents[2]
KILLED_WRITER = """
import os, signal, sys
from megatron_fr.utils.atomic_dir import atomic_directory
with atomic_directory(sys.argv[1]) as partial:
    (partial / "half.bin").write_bytes(b"x" * 1000)
    os.kill(os.getpid(), signal.SIGKILL)
"""


def leftovers(parent: Path, name: str) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith(f".{name}."))


def test_success_and_failure_leave_nothing_partial(tmp_path):
    with atomic_directory(tmp_path / "out") as partial:
        (partial / "file").write_text("done")
    assert (tmp_path / "out" / "file").read_text() == "done"
    assert leftovers(tmp_path, "out") == []
    with pytest.raises(RuntimeError), atomic_directory(tmp_path / "failed") as partial:
        (partial / "file").write_text("half")
        raise RuntimeError("interrupted")
    assert not (tmp_path / "failed").exists() and leftovers(tmp_path, "failed") == []
    with pytest.raises(FileExistsError, match="already exists"), atomic_directory(tmp_path / "out"):
        pass


def test_partial_output_of_a_killed_writer_is_removed_on_rerun(tmp_path, capsys):
    target = tmp_path / "out"
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_WRITER, str(target)],
        env=os.environ | {"PYTHONPATH": str(REPO)},
        timeout=120,
    )
    assert killed.returncode == -signal.SIGKILL
    stale = leftovers(tmp_path, "out")
    assert len(stale) == 2 and not target.exists()  # the partial directory and its owner record

    with atomic_directory(target) as partial:
        (partial / "file").write_text("done")

    assert (target / "file").read_text() == "done"
    assert leftovers(tmp_path, "out") == []
    message = capsys.readouterr().err
    assert f"removed {tmp_path / stale[0]}" in message and "no longer running" in message


def plant_partial(parent: Path, pid: int, record: dict | None) -> Path:
    partial = parent / f".out.partial-{pid}"
    partial.mkdir()
    (partial / "data").write_text("someone's work")
    if record is not None:
        (parent / f"{partial.name}.owner").write_text(json.dumps(record))
    return partial


def test_partials_that_may_still_be_in_use_are_left_alone(tmp_path, capsys):
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        host = socket.gethostname()
        start = int(Path(f"/proc/{live.pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
        running = plant_partial(
            tmp_path, live.pid, {"pid": live.pid, "start_time": start, "host": host}
        )
        unowned = plant_partial(tmp_path, 999_999_991, None)
        elsewhere = plant_partial(tmp_path, 999_999_992, {"pid": 999_999_992, "host": "other-node"})
        # The same pid, but a process started at another time: the pid was reused, owner gone.
        reused = tmp_path / "reused"
        reused.mkdir()
        reused_partial = plant_partial(
            reused, live.pid, {"pid": live.pid, "start_time": start - 1, "host": host}
        )

        with atomic_directory(tmp_path / "out"):
            pass
        with atomic_directory(reused / "out"):
            pass
    finally:
        live.kill()
        live.wait()
    for partial in (running, unowned, elsewhere):
        assert (partial / "data").exists(), partial
    assert not reused_partial.exists()
    message = capsys.readouterr().err
    assert f"left {running} in place (owner is running or on another host" in message
    assert f"left {unowned} in place (no owner record" in message
    assert f"removed {reused_partial}" in message
