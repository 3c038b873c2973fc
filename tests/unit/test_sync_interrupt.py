"""A weight sync gives up waiting on a hung engine when asked (weights/sync.py: `interrupted`,
polled by rank 0 while it waits on the engines' HTTP answers): SyncInterrupted within a poll
or two of the request, with the hung call left behind on a daemon thread; an engine's failure
is raised as before once every call has ended; and the ranks all raise SyncInterrupted when
rank 0 reports the interruption (`_raise_if_any` over a one-rank gloo group)."""

from __future__ import annotations

import threading
import time

import pytest

from megatron_fr.config.weights import WeightSyncConfig
from megatron_fr.demo.tiny_models import tiny_model_config
from megatron_fr.models.hf_config import load_hf_config
from megatron_fr.parallel import state
from megatron_fr.weights import sync as sync_module
from megatron_fr.weights.sync import SyncInterrupted, WeightSync, WeightSyncError
from megatron_fr.weights.transports import Engine

URLS = ["http://127.0.0.1:1", "http://127.0.0.1:2"]


def weight_sync() -> WeightSync:
    spec = load_hf_config(tiny_model_config(vocab_size=64))
    return WeightSync(WeightSyncConfig(), [Engine(url) for url in URLS], spec)


def test_a_stop_gives_up_a_wait_on_a_hung_engine_within_a_poll() -> None:
    sync, hung, stop = weight_sync(), threading.Event(), threading.Event()
    sync.interrupted = stop.is_set
    answered: list[str] = []

    def call(url: str) -> None:
        if url == URLS[1]:
            hung.wait(10.0)  # a stopped engine: no answer for longer than the test waits
        answered.append(url)

    threading.Timer(1.0, stop.set).start()
    started = time.monotonic()
    with pytest.raises(SyncInterrupted):
        sync._each_engine(call)
    took = time.monotonic() - started
    hung.set()
    assert answered[:1] == [URLS[0]]
    assert 1.0 <= took < 1.0 + 3 * sync_module.INTERRUPT_POLL_S, took


def test_an_engines_failure_is_raised_once_every_call_ended() -> None:
    sync, order = weight_sync(), []

    def call(url: str) -> None:
        if url == URLS[0]:
            raise WeightSyncError(f"{url} refused")
        time.sleep(0.3)
        order.append(url)

    with pytest.raises(WeightSyncError, match=r"127\.0\.0\.1:1 refused"):
        sync._each_engine(call)
    assert order == [URLS[1]]  # the other call ran to its end first


def test_every_rank_raises_sync_interrupted_when_rank_0_reports_it() -> None:
    state.initialize_single_process(seed=0)
    sync = weight_sync()
    sync.interrupted = lambda: True

    def hang() -> None:
        sync._each_engine(lambda url: time.sleep(5.0))

    failure = sync._attempt(True, "pause", hang)
    assert failure == sync_module.INTERRUPTED
    with pytest.raises(SyncInterrupted):
        sync_module._raise_if_any(failure)
    with pytest.raises(WeightSyncError, match="weight sync failed: rank 0 at pause: no"):
        sync_module._raise_if_any("rank 0 at pause: no")
