"""RUN_DIR/engines.txt through the real run: `megatron-fr train` on the CPU demo with two
engines it starts, while the file is written in turn with the six contents that used to end or
wedge a run:

    http://[::1                   a URL cut short ("Invalid IPv6 URL")
    \\xff\\xfe                      bytes that are not text
    the file a directory
    http://localhost:P,           the run's own engine under two other spellings
    http://0.0.0.0:P/
    40 URLs that never answer     sockets on 127.0.0.1 that accept and never reply; an engine
                                  of the run is SIGKILLed while they are probed
    the file a FIFO

Each is its line in faults.jsonl ("skipped" for a line or a file left out, "refused" for a URL
that did not answer), the run trains on throughout, the killed engine is out within seconds
of its death (its exit is seen by the watch, which the 40 probes do not hold up) and back once
restarted, and a STOP file then ends the run with exit 0, every step logged once. All traffic
stays on 127.0.0.0/8."""

from __future__ import annotations

import os
import signal
import time
import uuid

import pytest
from stub_server import mute_listeners
from test_elastic_fleet import Fleet
from test_fault_injection import prompt_files, start
from training_runs import records, wait_until

UNREACHABLE_S = 4
SETTINGS = [
    "steps=100000",  # a STOP file ends the run once the contents are through
    "rollout.engine.count=2",
    f"rollout.engine.unreachable_after_s={UNREACHABLE_S}",
    "rollout.engine.restart_backoff_s=1",
    "rollout.engine.restarts=3",
    "weights.timeout_s=20",
    "eval.every_steps=0",
    "checkpoint.every_steps=100000",
]


@pytest.mark.distributed
@pytest.mark.faults
def test_six_bad_engines_files_while_the_run_trains(tmp_path, demo_model):
    run_dir, marker = tmp_path / "run", uuid.uuid4().hex
    settings = [f"model.hf_dir={demo_model}", *prompt_files(tmp_path / "data"), *SETTINGS]
    fleet = Fleet(start(run_dir, marker, settings), run_dir)
    run, engines, mute = fleet.run, run_dir / "engines.txt", []

    def count(event: str) -> int:
        return sum(f["event"] == event for f in records(run_dir, "faults.jsonl", running=True))

    def recorded(expected: int, event: str = "skipped") -> None:
        """Until `expected` lines of `event` are in faults.jsonl, the run going on meanwhile."""
        run.wait_for(lambda: count(event) >= expected, 120, f"{expected} {event} lines")

    try:
        with run:
            run.wait_for(lambda: fleet.last_step() >= 3, 600, "step 3")
            own, victim = sorted(fleet.started())
            port = own.rsplit(":", 1)[1]
            steps_before = fleet.last_step()

            engines.write_text("http://[::1\n")  # 1
            recorded(1)
            engines.write_bytes(b"\xff\xfe\n")  # 2
            recorded(2)
            engines.unlink()
            engines.mkdir()  # 3
            recorded(3)
            engines.rmdir()
            engines.write_text(f"http://localhost:{port}\nhttp://0.0.0.0:{port}/\n")  # 4
            recorded(5)
            mute.extend(mute_listeners(40))  # 5
            engines.write_text("".join(f"http://127.0.0.1:{s.getsockname()[1]}\n" for s in mute))
            time.sleep(0.5)  # the probes are under way
            ins = fleet.events().count((victim, "in"))
            os.kill(fleet.started()[victim], signal.SIGKILL)
            killed = time.monotonic()
            wait_until(lambda: (victim, "out") in fleet.events(), 60, f"{victim} out")
            out_after = time.monotonic() - killed
            recorded(40, "refused")
            # Back in: its restart may have finished before the last refusal, or after it.
            run.wait_for(
                lambda: fleet.events().count((victim, "in")) > ins,
                300,
                f"{victim} back in after SIGKILL during the flood",
            )
            engines.unlink()
            os.mkfifo(engines)  # 6
            recorded(6)

            after = fleet.last_step()
            wait_until(lambda: fleet.last_step() >= after + 3, 300, "three steps after the FIFO")
            run.stop_cleanly(run_dir)
    finally:
        for listener in mute:
            listener.close()
    run.wait_gone()

    steps = fleet.steps()
    assert [r["step"] for r in steps] == list(range(1, len(steps) + 1)), run.output()[-3000:]
    assert steps[-1]["step"] >= steps_before + 3
    faults = records(run_dir, "faults.jsonl")
    skipped = [f["cause"] for f in faults if f["event"] == "skipped"]
    assert len(skipped) == 6, skipped
    assert skipped[0] == (
        f"{engines}:1: 'http://[::1' is not a URL (Invalid IPv6 URL); left out "
        "(write each engine as http(s)://HOST:PORT)"
    )
    assert skipped[1] == f"{engines}:1: not UTF-8 text; left out (one URL a line)"
    assert skipped[2].startswith(f"{engines}: not a regular file (a directory); left unread")
    at_own = f"is at the address of {own}, already in the pool; left out"
    assert sorted(skipped[3:5]) == [
        f"engines.txt: http://0.0.0.0:{port} {at_own}",
        f"engines.txt: http://localhost:{port} {at_own}",
    ]
    assert skipped[5].startswith(f"{engines}: not a regular file (a FIFO); left unread")
    refused = [f["cause"] for f in faults if f["event"] == "refused"]
    assert len(refused) == 40, refused
    assert all(f"no answer on GET /server_info within {UNREACHABLE_S} s" in c for c in refused)
    outs = [f for f in faults if f["event"] == "out"]
    # The watch may see the exit first, or a weight sync's probe of the dead engine may: the
    # cause then names that symptom after the exit code.
    assert [f["engine"] for f in outs] == [victim], outs
    assert outs[0]["cause"].startswith("exited with code -9"), outs
    last = steps[-1]
    assert last["engines_total"] == 2 and last["engines_serving"] == 2, last
    # Its exit is seen at the next watch pass (0.5 s); one probe at a time, the 40 would have
    # held the watch for 160 s.
    assert out_after < 10, out_after
    print(
        f"\nengines file through the run: {len(steps)} steps; an engine killed during the "
        f"flood was out after {out_after:.2f} s; 40 mute URLs refused; {len(skipped)} lines "
        "skipped"
    )
