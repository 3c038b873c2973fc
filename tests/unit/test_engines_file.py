"""RUN_DIR/engines.txt is input from outside the run: every bad content is left out with a line
in faults.jsonl while the pool goes on serving and its watch is not delayed.

The supervisor is the real one (rollout/supervisor.py), watching a pool of stand-in engines on
127.0.0.1 (tests/stub_server.py answering /server_info and /model_info as the CPU engine
does); network traffic stays on 127.0.0.0/8."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from stub_server import StubServer, mute_listeners

from megatron_fr.config.rollout import EngineSettings
from megatron_fr.rollout.engines_file import MAX_BYTES, EnginesFile
from megatron_fr.rollout.supervisor import ENGINES_FILE, FAULTS_FILE, EngineSupervisor
from megatron_fr.utils.engine_urls import url_problem


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ("http://[::1", "is not a URL (Invalid IPv6 URL)"),
        ("ftp://127.0.0.1:80", "is not an http(s) URL"),
        ("127.0.0.1:8000", "is not an http(s) URL"),
        ("http://:8000", "names no host"),
        ("http://127.0.0.1", "names no port"),
        ("http://127.0.0.1:99999", "is not a URL (Port out of range 0-65535)"),
        ("http://127.0.0.1:80/generate", "is not a server's root URL"),
        ("http://user@127.0.0.1:80", "is not a server's root URL"),
        ("http://127.0.0.1 :80", "holds spaces or control characters"),
        ("http://127.0.0.1:80\x00", "holds spaces or control characters"),
    ],
)
def test_a_line_that_cannot_name_an_engine_says_why(line, problem):
    assert url_problem(line).startswith(problem), url_problem(line)


def test_good_lines_are_kept_once_in_order_and_bad_ones_named_by_line(tmp_path):
    path = tmp_path / ENGINES_FILE
    path.write_bytes(
        b"# the fleet\nhttp://127.0.0.1:8001/\n\xff\xfe\n  https://LocalHost:8002  \n"
        b"http://127.0.0.1:8001\nhttp://[::1]:8003\n"
    )
    listing = EnginesFile(path).changed()
    assert listing.urls == ["http://127.0.0.1:8001", "https://localhost:8002", "http://[::1]:8003"]
    assert listing.problems == [
        f"{path}:3: not UTF-8 text; left out (one URL a line)",
        f"{path}:5: http://127.0.0.1:8001 is listed already on line 2; left out",
    ]


def test_the_file_is_read_when_it_changed_only_and_never_opened_unless_regular(tmp_path):
    path = tmp_path / ENGINES_FILE
    reader = EnginesFile(path)
    assert reader.changed() is None  # absent
    path.write_text("http://127.0.0.1:8001\n")
    assert reader.changed().urls == ["http://127.0.0.1:8001"]
    assert reader.changed() is None  # unchanged
    path.unlink()
    os.mkfifo(path)  # opening it to read would wait for a writer
    (problem,) = reader.changed().problems
    assert problem.startswith(f"{path}: not a regular file (a FIFO); left unread")
    assert reader.changed() is None
    path.unlink()
    path.write_bytes(b"#" * (MAX_BYTES + 10) + b"\nhttp://127.0.0.1:8001\n")
    listing = reader.changed()
    assert listing.urls == [] and listing.problems[0].endswith("the rest is left out")


# --- the real supervisor, the six bad contents while the pool goes on ------------------------


def cpu_engine_info(instance: str) -> dict:
    """/server_info as the CPU engine answers it (engine/cpu/server.py), trimmed to what the
    reader needs."""
    return {"engine": "megatron-fr-cpu", "tp_size": 1, "pp_size": 1, "instance_id": instance}


def stand_in(instance: str) -> StubServer:
    return StubServer(
        {"/server_info": [(200, cpu_engine_info(instance))], "/model_info": [(200, {})]}
    )


class Watch:
    """supervisor.watch() in a thread of its own, as the rollout process runs it."""

    def __init__(self, supervisor: EngineSupervisor) -> None:
        self.supervisor, self.error = supervisor, None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=asyncio.run, args=(self._run(),), daemon=True)
        self._thread.start()

    async def _run(self) -> None:
        watch = asyncio.create_task(self.supervisor.watch())
        while not self._stop.is_set() and not watch.done():
            await asyncio.sleep(0.05)
        watch.cancel()
        try:
            await watch
        except asyncio.CancelledError:
            pass
        except Exception as error:  # what ended the watch: the test fails naming it
            self.error = error

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


def faults(run_dir: Path) -> list[dict]:
    path = run_dir / FAULTS_FILE
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def wait_for(what: str, condition: Callable[[], bool], timeout_s: float) -> float:
    """Seconds until `condition` held; AssertionError naming `what` past timeout_s."""
    began = time.monotonic()
    while not condition():
        assert time.monotonic() - began < timeout_s, f"no {what} within {timeout_s} s"
        time.sleep(0.05)
    return time.monotonic() - began


def test_the_engines_file_with_six_bad_contents_while_the_pool_goes_on(tmp_path):
    """In turn: a URL cut short, bytes that are not text, the file a directory, the pool's own
    engine under two other spellings, 40 URLs that never answer (an engine of the pool killed
    meanwhile), a FIFO. Each bad content is one or more lines in faults.jsonl, the watch never
    ends, the engine that stays serves throughout, the killed one is taken out within
    unreachable_after_s of its death although the 40 probes take five times that; then a good
    line still joins, and an alias of the pool's engine (its /server_info instance id on
    another port) does not."""
    window = 2.0
    settings = EngineSettings(
        watch_interval_s=0.1, unreachable_after_s=window, start_timeout_s=60.0, file_probes=8
    )
    engines = tmp_path / ENGINES_FILE
    with stand_in("own") as own, stand_in("victim") as victim, stand_in("new") as new:
        settings = settings.model_copy(update={"urls": [own.url, victim.url]})
        supervisor = EngineSupervisor.start(settings, tmp_path, tmp_path, run_dir=tmp_path)
        watch = Watch(supervisor)
        port = own.url.rsplit(":", 1)[1]

        def recorded(count: int, event: str = "skipped") -> bool:
            return sum(f["event"] == event for f in faults(tmp_path)) >= count

        try:
            engines.write_text("http://[::1\n")  # 1. a URL cut short
            wait_for("warning of the cut URL", lambda: recorded(1), 10)
            engines.write_bytes(b"\xff\xfe\n")  # 2. not text
            wait_for("warning of the bytes", lambda: recorded(2), 10)
            engines.unlink()
            engines.mkdir()  # 3. a directory
            wait_for("warning of the directory", lambda: recorded(3), 10)
            engines.rmdir()
            engines.write_text(f"http://localhost:{port}\nhttp://0.0.0.0:{port}/\n")  # 4.
            wait_for("warnings of the own engine", lambda: recorded(5), 10)
            mute = mute_listeners(40)  # 5. a flood of URLs that never answer
            engines.write_text("".join(f"http://127.0.0.1:{s.getsockname()[1]}\n" for s in mute))
            written = time.monotonic()
            time.sleep(0.3)  # the probes are under way
            victim.__exit__()  # an engine of the pool dies meanwhile
            died = time.monotonic()
            wait_for("the dead engine out", lambda: recorded(1, "out"), 3 * window)
            out_after = time.monotonic() - died
            wait_for("40 refusals", lambda: recorded(40, "refused"), 60)
            flood = time.monotonic() - written
            engines.unlink()
            os.mkfifo(engines)  # 6. a FIFO
            wait_for("warning of the FIFO", lambda: recorded(6), 10)
            engines.unlink()
            with stand_in("own") as alias:  # a good line, and the own engine on another port
                engines.write_text(f"{new.url}\n{alias.url}\n")
                wait_for("the new engine", lambda: recorded(1, "joining"), 10)
                wait_for("the alias left out", lambda: recorded(7), 10)
            for listener in mute:
                listener.close()
        finally:
            watch.stop()
            supervisor.stop()
    print(
        f"\nengine killed during the flood: out after {out_after:.2f} s; 40 mute URLs refused "
        f"after {flood:.2f} s (unreachable_after_s {window:g}, file_probes 8)"
    )
    assert watch.error is None and not watch._thread.is_alive()
    records = faults(tmp_path)
    skipped = [f["cause"] for f in records if f["event"] == "skipped"]
    assert skipped[0] == (
        f"{engines}:1: 'http://[::1' is not a URL (Invalid IPv6 URL); left out "
        "(write each engine as http(s)://HOST:PORT)"
    )
    assert skipped[1] == f"{engines}:1: not UTF-8 text; left out (one URL a line)"
    assert skipped[2].startswith(f"{engines}: not a regular file (a directory); left unread")
    at_own = f"is at the address of {own.url}, already in the pool; left out"
    assert sorted(skipped[3:5]) == [  # probed at once: either may finish first
        f"{ENGINES_FILE}: http://0.0.0.0:{port} {at_own}",
        f"{ENGINES_FILE}: http://localhost:{port} {at_own}",
    ]
    assert skipped[5].startswith(f"{engines}: not a regular file (a FIFO); left unread")
    assert skipped[6] == (
        f"{ENGINES_FILE}: {alias.url} is {own.url} of the pool (the same /server_info "
        "instance_id); left out"
    )
    assert len(skipped) == 7
    refused = [f for f in records if f["event"] == "refused"]
    assert len(refused) == 40 and all(
        f"no answer on GET /server_info within {window:g} s" in f["cause"] for f in refused
    )
    # The watch went on: the death seen within the window (plus watch intervals, with slack
    # for a loaded machine), while the 40 probes, 8 at a time, took at least 4 windows (one
    # at a time they would take 20, and the death would wait for them).
    assert out_after < window + 2.0, out_after
    assert flood >= 4 * window, flood
    assert [(f["engine"], f["event"]) for f in records if f["event"] in ("out", "joining")] == [
        (victim.url, "out"),
        (new.url, "joining"),
    ]
    assert supervisor.members[own.url].state == "serving"
    assert supervisor.membership()[1] == [own.url, new.url]
