"""What `megatron-fr train` checks of its environment before starting anything, and how a rank
that fails on its storage ends: one line naming the file (the fuzz suite, tests/fuzz, runs the
command line through all of it)."""

from __future__ import annotations

import argparse
import errno
import os
from pathlib import Path

import pytest
import torch

from megatron_fr.orchestrator import preflight, train_cli


class CheckpointWriteFailed(RuntimeError):
    """What a library wrapping the OSError raises (torch's checkpoint writer does)."""


def disk_full(filename: str | None) -> BaseException:
    try:
        raise OSError(errno.ENOSPC, "No space left on device", filename)
    except OSError as error:
        try:
            raise CheckpointWriteFailed("rank 0 failed to write its shards") from error
        except CheckpointWriteFailed as wrapped:
            return wrapped


def test_a_storage_error_is_found_through_the_causes_and_names_the_file(tmp_path):
    line = preflight.describe_storage_error(disk_full(str(tmp_path / "x.distcp")), tmp_path)
    assert line.startswith(f"{tmp_path / 'x.distcp'}: No space left on device (")
    assert "GiB free there" in line and "resumes the run" in line
    nameless = preflight.describe_storage_error(disk_full(None), tmp_path)
    assert nameless.startswith(f"{tmp_path}: No space left on device")
    assert preflight.describe_storage_error(ValueError("not storage"), tmp_path) is None


def test_a_rank_that_runs_out_of_disk_ends_with_one_line(tmp_path, monkeypatch, capsys):
    from megatron_fr.orchestrator import controller
    from megatron_fr.utils import parent_watch

    def train(config, run_dir):
        raise disk_full(str(run_dir / "metrics.jsonl"))

    monkeypatch.setattr(controller, "train", train)
    monkeypatch.setattr(parent_watch, "exit_when_parent_dies", lambda: None)
    monkeypatch.setattr(torch, "set_num_threads", lambda threads: None)
    assert train_cli.run_rank(None, tmp_path / "run") == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"megatron-fr train: error: {tmp_path / 'run' / 'metrics.jsonl'}: ")


@pytest.mark.parametrize(
    ("env", "names"),
    [
        ({"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "torchrun"),
        ({"WORLD_SIZE": "1", "RANK": "0"}, "MASTER_ADDR"),
        ({"WORLD_SIZE": "2", "RANK": "-1"}, "RANK='-1'"),
        ({"RANK": "0"}, "WORLD_SIZE=None"),
    ],
)
def test_launcher_variables_set_by_hand_are_refused(monkeypatch, env, names):
    for name in ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT", preflight.TORCHRUN_MARKER):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=names.replace("(", r"\(")):
        preflight.launch_environment()


def test_torchrun_ranks_and_a_command_started_by_hand_pass(monkeypatch):
    for name in ("WORLD_SIZE", "RANK", preflight.TORCHRUN_MARKER):
        monkeypatch.delenv(name, raising=False)
    assert preflight.launch_environment() is None
    variables = {
        "WORLD_SIZE": "2",
        "RANK": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
        preflight.TORCHRUN_MARKER: "none",
    }
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    assert preflight.launch_environment() == (1, 2)


def test_arguments_out_of_range_are_refused():
    for world, memory in [(-1, None), (0, float("nan")), (0, -3.0), (0, float("inf"))]:
        with pytest.raises(ValueError):
            train_cli._check_arguments(argparse.Namespace(world_size=world, gpu_mem_gb=memory))
    train_cli._check_arguments(argparse.Namespace(world_size=0, gpu_mem_gb=80.0))


def test_a_run_directory_gets_a_probe_file_that_does_not_stay(tmp_path: Path):
    preflight.check_run_dir(tmp_path / "new" / "run")
    assert list(tmp_path.iterdir()) == []


def engine_config(*overrides: str):
    from megatron_fr.config.run import load_run_config

    recipe = Path(__file__).resolve().parents[2] / "examples" / "cpu_demo.yaml"
    return load_run_config(recipe, list(overrides))


def test_an_engine_given_by_url_is_waited_for_until_its_start_timeout(monkeypatch, capsys):
    """One still starting is waited for (the run would wait too); one that never answers is
    said to be waited for at its first failure, then refused at the deadline, naming the URL
    and the setting; a URL that is none is refused by the recipe's check, at once."""
    import http.server
    import threading
    import time

    from megatron_fr.utils.net import free_port

    port = free_port()

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"ok")

    server: list = []

    def serve_late() -> None:
        time.sleep(1.5)
        server.append(http.server.HTTPServer(("127.0.0.1", port), Health))
        server[0].serve_forever()

    threading.Thread(target=serve_late, daemon=True).start()
    url = f"rollout.engine.urls=[http://127.0.0.1:{port}]"
    try:
        preflight.check_engines(engine_config(url, "rollout.engine.start_timeout_s=30"), 0.2)
    finally:
        if server:
            server[0].shutdown()
    silent = f"http://127.0.0.1:{free_port()}"
    capsys.readouterr()
    started = time.monotonic()
    with pytest.raises(ValueError, match=r"has not answered GET /health within .*=1 s"):
        preflight.check_engines(
            engine_config(f"rollout.engine.urls=[{silent}]", "rollout.engine.start_timeout_s=1"),
            0.2,
        )
    assert time.monotonic() - started < 10
    waiting = capsys.readouterr().err.splitlines()
    assert len(waiting) == 1, waiting  # the first failure, then one each report_every_s (10 s)
    assert waiting[0].startswith(f"waiting for the engine {silent} to answer GET /health: 0 s")
    with pytest.raises(ValueError, match="'nonsense' is not an http\\(s\\) URL"):
        engine_config("rollout.engine.urls=[nonsense]")
    with pytest.raises(ValueError, match=r"'http://\[::1' is not a URL \(Invalid IPv6 URL\)"):
        engine_config("rollout.engine.urls=['http://[::1']")


@pytest.mark.parametrize(
    "make, problem",
    [
        (lambda run: (run / "metrics.jsonl").mkdir(), "metrics.jsonl is a directory"),
        (lambda run: (run / "checkpoints").write_text("x"), "checkpoints is a file"),
        (lambda run: (run / "faults.jsonl").symlink_to("faults.jsonl"), "a symlink loop"),
        (lambda run: (run / "logs").symlink_to(run / "gone"), "logs is a symlink to nothing"),
        (lambda run: os.mkfifo(run / "config.yaml"), "config.yaml is special"),
    ],
)
def test_a_run_directory_with_a_part_of_the_wrong_kind_is_refused_in_one_line(
    tmp_path: Path, make, problem
):
    """A part the run writes, of a kind it cannot write, is named before anything starts (the
    run would die of it at its first write: checkpoints after the first steps)."""
    run = tmp_path / "run"
    run.mkdir()
    make(run)
    with pytest.raises(ValueError, match=problem) as refused:
        preflight.check_run_dir(run)
    assert "\n" not in str(refused.value)


def test_a_run_directory_that_is_a_symlink_loop_is_refused(tmp_path: Path):
    (tmp_path / "run").symlink_to(tmp_path / "run")
    with pytest.raises(ValueError, match="a symlink loop"):
        preflight.check_run_dir(tmp_path / "run")
