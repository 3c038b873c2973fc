"""Fuzz of the files a run reads while it trains, from outside it: RUN_DIR/engines.txt (the
live engines file, rollout/engines_file.py) holding URLs that name no engine, bytes that are
not text, lines past its size, and being a directory, a FIFO, a symlink loop; and good
listings. Each read is one call of the run's own reader, judged as a command would be
(tests/fuzz/fuzz_harness.py): a bad content must give a problem line naming the file (and
line) and leave the bad URL out, never raise, hang or admit it; a good one must list its URLs
with no problem. What the supervisor does with the problems (faults.jsonl, the run going on)
is tests/unit/test_engines_file.py's and tests/faults/test_engines_file_run.py's."""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path

from fuzz_harness import Case, assert_sound, report, run_case

from megatron_fr.rollout.engines_file import MAX_BYTES, EnginesFile

SEED = 34
GOOD_URL = "http://127.0.0.1:30000"


def read_engines_file(argv: list[str]) -> int:
    """The run's read of one engines file, as a command: each problem an `error:` line on
    stderr (exit 2), else the URLs on stdout (exit 0)."""
    listing = EnginesFile(Path(argv[0])).changed()
    if listing is None:
        return 0
    for problem in listing.problems:
        print(f"error: {problem}", file=sys.stderr)
    print("\n".join(listing.urls))
    return 2 if listing.problems else 0


def lines_case(ws: Path, name: str, data: bytes, names: str | None) -> Case:
    path = ws / "engines" / name
    path.write_bytes(data)
    return Case(f"engines.txt: {name}", [str(path)], names)


def bad_lines(rng: random.Random) -> dict[str, bytes]:
    """Contents with one line that names no engine (beside a good one)."""
    lines = {
        "ipv6_cut_short": b"http://[::1",
        "not_utf8": b"\xff\xfe",
        "file_scheme": b"file:///etc/passwd",
        "no_scheme": b"127.0.0.1:30000",
        "port_99999": b"http://127.0.0.1:99999",
        "port_0": b"http://127.0.0.1:0",
        "no_port": b"http://127.0.0.1",
        "a_path": b"http://127.0.0.1:30000/generate",
        "a_user": b"http://admin@127.0.0.1:30000",
        "a_query": b"http://127.0.0.1:30000?x=1",
        "ftp": b"ftp://127.0.0.1:21",
        "no_host": b"http://:30000",
        "a_nul": b"http://127.0.0.1:30000\x00",
        "two_urls": b"http://127.0.0.1:1 http://127.0.0.1:2",
        "a_tab_inside": b"http://127.0.0.1:\t30000",
        "control_chars": bytes([rng.randrange(1, 32) for _ in range(12)]).replace(b"\n", b"\x01"),
        "random_bytes": rng.randbytes(64).replace(b"\n", b" ").replace(b"#", b"x"),
        "a_bom_mid_file": b"\xef\xbb\xbfhttp://127.0.0.1:1",
        "javascript": b"javascript:alert(1)",
        "port_words": b"http://127.0.0.1:http",
    }
    return {name: GOOD_URL.encode() + b"\n" + line + b"\n" for name, line in lines.items()}


def bad_cases(ws: Path, rng: random.Random) -> list[Case]:
    cases = [lines_case(ws, name, data, f"{name}:2") for name, data in bad_lines(rng).items()]
    cases.append(
        lines_case(ws, "twice", f"{GOOD_URL}\nhttp://127.0.0.1:30000/\n".encode(), "twice:2")
    )
    flood = "".join(f"http://127.0.0.1:{1 + i % 60000}\n" for i in range(MAX_BYTES // 20))
    flooded = lines_case(ws, "past_the_size", flood.encode(), f"past {MAX_BYTES} bytes")
    flooded.one_line = False  # two problems: the size, and the line the limit cuts in two
    cases.append(flooded)
    shapes = ws / "engines"
    (shapes / "a_directory").mkdir()
    os.mkfifo(shapes / "a_fifo")
    (shapes / "a_loop").symlink_to(shapes / "a_loop")
    for name in ("a_directory", "a_fifo", "a_loop"):
        cases.append(Case(f"engines.txt: {name}", [str(shapes / name)], name, deadline_s=10))
    return cases


def good_cases(ws: Path) -> list[Case]:
    contents = {
        "one": f"{GOOD_URL}\n",
        "comments_and_gaps": f"# pool\n\n  {GOOD_URL}/  \n\n# end\n",
        "crlf": f"{GOOD_URL}\r\nhttps://[::1]:8443\r\n",
        "names": "http://localhost:30001\nhttp://engine-3.cluster.local:30000\n",
        "empty": "",
        "no_final_newline": GOOD_URL,
    }
    return [lines_case(ws, name, text.encode(), None) for name, text in contents.items()]


def test_fuzz_runtime_files(tmp_path):
    seed = int(os.environ.get("FUZZ_SEED", SEED))
    (tmp_path / "engines").mkdir()
    cases = [*bad_cases(tmp_path, random.Random(seed)), *good_cases(tmp_path)]
    results = [run_case(case, read_engines_file) for case in cases]
    assert_sound(report("run-time files", seed, results))
