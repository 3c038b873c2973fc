"""The engine pool (rollout/supervisor.py) against real SGLang 0.5.23 on CPU, the tier's one
server: the pool identifies a server it is given by URL from SGLang's own GET /server_info
(kind, sizes), refuses it for routing replay with the flag SGLang lacks
(--enable-return-routed-experts: /server_info says it is off), and, with its URL in the
engines file under another spelling, leaves that line out as the engine it already has instead
of probing it as a new one (faults.jsonl says so)."""

from __future__ import annotations

import asyncio
import contextlib
import threading

import pytest
from training_runs import records, wait_until

from megatron_fr.config.rollout import EngineSettings
from megatron_fr.rollout.supervisor import (
    ENGINES_FILE,
    FAULTS_FILE,
    EngineRefused,
    EngineSupervisor,
)

pytestmark = pytest.mark.sglang


def test_the_pool_reads_real_sglang_and_refuses_it_for_routing_replay(sglang_server, tmp_path):
    url, _ = sglang_server
    settings = EngineSettings(urls=[url], watch_interval_s=0.1, unreachable_after_s=5)
    supervisor = EngineSupervisor.start(settings, tmp_path, tmp_path, run_dir=tmp_path)
    try:
        assert supervisor.kind == "sglang"
        info = supervisor.check(url, routed_experts=False)
        assert (info.kind, info.tp_size, info.routed_experts) == ("sglang", 1, False)
        with pytest.raises(EngineRefused, match="start it with --enable-return-routed-experts"):
            supervisor.check(url, routed_experts=True)
        port = url.rsplit(":", 1)[1]
        (tmp_path / ENGINES_FILE).write_text(f"http://localhost:{port}/\n")
        watch = threading.Thread(target=_watch_for, args=(supervisor, 10.0), daemon=True)
        watch.start()
        wait_until(lambda: records(tmp_path, FAULTS_FILE, running=True), 10, "the line's fate")
    finally:
        supervisor.stop()
    (fault,) = records(tmp_path, FAULTS_FILE)
    assert fault["event"] == "skipped", fault
    expected = f"http://localhost:{port} is at the address of {url}, already in the pool"
    assert expected in fault["cause"], fault


def _watch_for(supervisor: EngineSupervisor, seconds: float) -> None:
    """The pool's watch, as the rollout process runs it, for `seconds`."""

    async def bounded() -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(supervisor.watch(), seconds)

    asyncio.run(bounded())
