"""One call's memory is bounded for all of its processes together, and the calls running at
once are capped, so model-written code cannot take the node's memory (nor make the OOM killer
pick the trainer).

The attacks run 16 processes in one call (max_processes), each trying to hold 440 MiB, or as
much as it can get. What the call held is measured twice: by the kernel (the call's cgroup
records its peak) and by this test, which samples the proportional resident memory (Pss, from
/proc/PID/smaps_rollup) of every process of the call. Without a bound the call would hold
16 x 440 MiB = 6.9 GiB; the sampler kills the call past twice the bound, so a broken bound fails
the test and not the machine. Sampling reads the processes one after another while others
allocate or are OOM-killed, so a sample can count memory that moved between two processes
during one sweep. The test prints its figures; over the bound of 1 GiB they went up to 20 MiB,
and SKEW allows 64 MiB (the kernel's own peak has no skew: it must be within the bound).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest
from test_sandbox_isolation import RLIMITS, RLIMITS_USABLE, leftovers

from megatron_fr.envs.sandbox import BOOT, WEAKER_ISOLATION, WEAKER_MEMORY, Sandbox, SandboxConfig
from megatron_fr.envs.sandbox_memory import MemoryBound

ROOT = os.geteuid() == 0
NAMESPACES = ROOT and Sandbox(SandboxConfig()).isolation == "namespaces"
try:
    CGROUP_REASON = MemoryBound.detect(2**30, "cgroup", None).kind
except ValueError as error:
    CGROUP_REASON = str(error)
CGROUP = CGROUP_REASON.startswith("cgroup")
SKEW = 64 * 2**20

FORK_16 = """
import os, time
children = []
for _ in range(15):
    pid = os.fork()
    if pid == 0:
        children = []
        break
    children.append(pid)
os.write(1, b"start\\n")  # one write: lines never interleave
"""
"""16 processes (the default max_processes); the first one waits for the others before it ends
(its exit would end the call), whatever happened to it."""
HOLD_440_MB = (
    FORK_16
    + """
try:
    block = b"\\x01" * (440 * 2**20)
    os.write(1, b"held 440 MiB\\n")
    time.sleep(3)
finally:
    for pid in children:
        os.waitpid(pid, 0)
"""
)
FILL_AND_HOLD = (
    FORK_16
    + """
blocks = []
try:
    while True:
        blocks.append(b"\\x01" * 2**22)
except MemoryError:
    os.write(1, f"held {len(blocks) * 4} MiB\\n".encode())
    time.sleep(2)
    raise
finally:
    for pid in children:
        os.waitpid(pid, 0)
"""
)
ATTACKS = {"16 x 440 MiB": HOLD_440_MB, "16 x fill until refused": FILL_AND_HOLD}


class CallSampler:
    """On a thread: the most memory (summed Pss) and the most calls this process's sandbox
    calls held at once. A call is a supervisor (our child running sandbox_boot.py) and all of
    its descendants; past `kill_above` bytes every process of it is SIGKILLed."""

    def __init__(self, kill_above: int | None = None) -> None:
        self.kill_above = kill_above
        self.peak_bytes = self.max_calls = self.samples = 0
        self.killed_at: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> CallSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._stop.is_set():
            pids, calls = set(), 0
            for child in psutil.Process().children():
                try:
                    if str(BOOT) in child.cmdline():
                        calls += 1
                        pids |= {child.pid, *(p.pid for p in child.children(recursive=True))}
                except psutil.Error:
                    continue
            total = sum(map(_pss, pids))
            self.peak_bytes, self.samples = max(self.peak_bytes, total), self.samples + 1
            self.max_calls = max(self.max_calls, calls)
            if self.kill_above is not None and total > self.kill_above:
                self.killed_at = total
                for pid in pids:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
            self._stop.wait(0.002)


def _pss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as rollup:
            for line in rollup:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:  # exited while we looked
        pass
    return 0


MODES = {
    "namespaces+cgroup": pytest.param(
        SandboxConfig(isolation="namespaces", memory_limit="cgroup"),
        marks=pytest.mark.skipif(not (NAMESPACES and CGROUP), reason=CGROUP_REASON),
    ),
    "namespaces+rlimits": pytest.param(
        SandboxConfig(isolation="namespaces", memory_limit="rlimits"),
        marks=pytest.mark.skipif(not NAMESPACES, reason="needs root with CAP_SYS_ADMIN"),
    ),
    "rlimits+rlimits": pytest.param(
        RLIMITS.model_copy(update={"memory_limit": "rlimits", "wall_timeout_s": 10}),
        marks=pytest.mark.skipif(not RLIMITS_USABLE, reason="needs root, an interpreter"),
    ),
}


@pytest.mark.parametrize("config", MODES.values(), ids=MODES.keys())
def test_sandbox_memory_attacks_stay_within_the_call_bound(config: SandboxConfig, capsys) -> None:
    sandbox = Sandbox(config)
    bound, cgroup = config.memory_bytes, config.memory_limit == "cgroup"
    for name, code in ATTACKS.items():
        with CallSampler(kill_above=2 * bound) as sampler:
            result = sandbox.run(code)
        started = result.stdout.count("start\n")
        held = [int(n) for n in re.findall(r"held (\d+) MiB", result.stdout)]
        refused = result.stderr.count("MemoryError")
        with capsys.disabled():
            print(
                f"\n[{sandbox.isolation}+{result.memory_limit}] {name}: {started} processes "
                f"started, {refused} allocations refused with MemoryError, status "
                f"{result.status}; bound {bound} B, kernel peak {result.memory_peak_bytes} B, "
                f"sampled Pss peak {sampler.peak_bytes} B over {sampler.samples} samples"
            )
        assert sampler.killed_at is None, f"the call held {sampler.killed_at} B: no bound"
        assert sampler.peak_bytes <= bound + SKEW
        assert result.tool_error and leftovers(result) == []
        assert result.memory_limit.startswith("cgroup") == cgroup
        if cgroup:  # the kernel OOM-kills inside the call's cgroup once it is full
            assert result.status == "memory_limit", result
            assert result.memory_peak_bytes <= bound
            assert sampler.peak_bytes > bound // 2, "the attack pressed on the bound"
        else:  # each process's share of the bound is refused, at once, with MemoryError
            assert result.status == "error" and started == 16 and result.memory_peak_bytes is None
            assert refused == 16 if name == "16 x 440 MiB" else sum(held) * 2**20 <= bound
    if cgroup:
        parent = sandbox._memory.parent
        assert not list(parent.glob("mfr-sandbox-*")), "each call's cgroup is removed"


def test_sandbox_runs_at_most_max_concurrent_runs_calls_at_once() -> None:
    sandbox = Sandbox(SandboxConfig(max_concurrent_runs=2))
    code = "import time\ntime.sleep(1)\nprint('done')"
    with CallSampler() as sampler, ThreadPoolExecutor(6) as pool:
        results = list(pool.map(sandbox.run, [code] * 6))
    assert [r.stdout for r in results] == ["done\n"] * 6
    assert sampler.max_calls == 2, sampler.max_calls


def test_sandbox_refuses_to_promise_more_than_half_the_node() -> None:
    node = psutil.virtual_memory().total
    with pytest.raises(ValueError, match="max_concurrent_runs x memory_bytes"):
        Sandbox(SandboxConfig(max_concurrent_runs=2, memory_bytes=node // 4 + 2**20))
    assert Sandbox(SandboxConfig(max_concurrent_runs=2, memory_bytes=node // 8)).config


@pytest.mark.skipif(not NAMESPACES, reason="needs root with CAP_SYS_ADMIN")
def test_sandbox_rlimits_bound_is_an_equal_share_and_says_it_is_weaker(caplog) -> None:
    config = SandboxConfig(memory_limit="rlimits", max_processes=16, disk_bytes=32 * 2**20)
    with caplog.at_level(logging.WARNING, logger="megatron_fr.sandbox"):
        sandbox = Sandbox(config)
    assert "RLIMIT_AS shares only" in caplog.text and "WEAKER" in caplog.text
    result = sandbox.run("import resource\nprint(resource.getrlimit(resource.RLIMIT_AS)[0])")
    assert int(result.stdout) == (2**30 - 32 * 2**20) // 16
    assert (result.memory_limit, result.memory_peak_bytes) == ("rlimits", None)
    assert sandbox.weaknesses == [WEAKER_MEMORY]
    with pytest.raises(ValueError, match=r"leaves \d+ bytes per process for max_processes=64"):
        Sandbox(SandboxConfig(memory_limit="rlimits", memory_bytes=2**30, max_processes=64))


@pytest.mark.skipif(not RLIMITS_USABLE, reason="needs root and an interpreter others may run")
def test_sandbox_rlimits_isolation_is_reported_weaker_once(caplog) -> None:
    sandbox = Sandbox(RLIMITS)
    with caplog.at_level(logging.WARNING, logger="megatron_fr.sandbox"):
        for _ in range(2):
            assert sandbox.run("print(1)").isolation == "rlimits"
    assert caplog.text.count(WEAKER_ISOLATION) == 1
    assert WEAKER_ISOLATION in sandbox.weaknesses


@pytest.mark.skipif(not (ROOT and CGROUP), reason=CGROUP_REASON)
def test_sandbox_cgroup_bound_is_logged_and_one_process_may_use_all_of_it(caplog) -> None:
    with caplog.at_level(logging.INFO, logger="megatron_fr.sandbox"):
        sandbox = Sandbox(SandboxConfig(memory_limit="cgroup"))
    assert re.search(r"sandbox memory bound: 1073741824 bytes per call, cgroup v[12]", caplog.text)
    result = sandbox.run("block = b'x' * (600 * 10**6)\nprint(len(block))")
    assert result.stdout == "600000000\n" and result.status == "ok"
    assert 600 * 10**6 < result.memory_peak_bytes <= 2**30
    assert WEAKER_MEMORY not in sandbox.weaknesses
