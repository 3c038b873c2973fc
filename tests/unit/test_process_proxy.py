"""The process proxy (utils/process_proxy.py) against a real spawned child: a value keeps its
type, an EngineDied raised in the child arrives as EngineDied (a service error keeps its class
across the process boundary), an exception that cannot be pickled arrives as RemoteError with
its class and message, a method not on the protocol is refused without reaching the child, and
a child that dies is ProcessDied with its exit code. Also: the rollout process's protocol is
the one RolloutService implements, signature for signature."""

from __future__ import annotations

import inspect
import os
import threading
from typing import Protocol

import pytest

from megatron_fr.orchestrator.rollout_process import RolloutHost, RunRollout
from megatron_fr.rollout.control import RolloutControl
from megatron_fr.rollout.service import RolloutService
from megatron_fr.rollout.supervisor import EngineDied
from megatron_fr.utils.process_proxy import ProcessDied, ProcessProxy, RemoteError


class Pool(Protocol):
    def membership(self) -> tuple[int, list[str]]: ...

    def take_out(self, urls: list[str], cause: str) -> None: ...

    def pid(self) -> int: ...

    def exit_now(self, code: int) -> None: ...

    def close(self) -> None: ...


class Unpicklable(RuntimeError):
    """Holds a lock: pickle refuses it."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.lock = threading.Lock()


class FakePool:
    """Serves Pool in the child; its errors are those the rollout service raises."""

    def __init__(self, urls: list[str]) -> None:
        self.urls = urls

    def membership(self) -> tuple[int, list[str]]:
        return 3, self.urls

    def take_out(self, urls: list[str], cause: str) -> None:
        if cause == "unpicklable":
            raise Unpicklable(f"cannot take out {urls}")
        raise EngineDied(f"inference engine {urls[0]} exited with code -9 ({cause})")

    def pid(self) -> int:
        return os.getpid()

    def exit_now(self, code: int) -> None:
        os._exit(code)

    def close(self) -> None:
        pass

    def not_in_the_protocol(self) -> str:
        return "reached the child"


@pytest.fixture(scope="module")
def pool():
    proxy = ProcessProxy[Pool](
        Pool, FakePool, (["http://e:1"],), name="test pool", ready_timeout_s=120
    )
    yield proxy
    proxy.close()


def test_a_value_keeps_its_type_and_the_call_runs_in_the_child(pool) -> None:
    assert pool.remote.membership() == (3, ["http://e:1"])
    assert pool.remote.pid() == pool.process.pid != os.getpid()


def test_engine_died_in_the_child_arrives_as_engine_died(pool) -> None:
    with pytest.raises(EngineDied, match=r"http://e:1 exited with code -9 \(wedged\)") as caught:
        pool.remote.take_out(["http://e:1"], "wedged")
    notes = "\n".join(caught.value.__notes__)
    assert f"raised in the test pool (pid {pool.process.pid})" in notes
    assert "in take_out" in notes  # the child's traceback, down to the frame that raised
    assert pool.remote.membership()[0] == 3  # the child serves on


def test_an_exception_that_cannot_be_pickled_arrives_as_remote_error(pool) -> None:
    with pytest.raises(RemoteError, match=r"Unpicklable: cannot take out \['http://e:1'\]"):
        pool.remote.take_out(["http://e:1"], "unpicklable")


def test_a_method_not_on_the_protocol_is_refused(pool) -> None:
    with pytest.raises(AttributeError, match="not_in_the_protocol is not a method of Pool"):
        pool.remote.not_in_the_protocol()
    with pytest.raises(AttributeError, match="not_in_the_protocol is not a method the test pool"):
        pool.call("not_in_the_protocol", ())
    assert pool.remote.membership()[0] == 3


def test_a_child_that_dies_is_process_died_with_its_exit_code() -> None:
    proxy = ProcessProxy[Pool](Pool, FakePool, ([],), name="test pool", ready_timeout_s=120)
    pid = proxy.process.pid
    with pytest.raises(ProcessDied, match=rf"test pool \(pid {pid}\) exited with code 7"):
        proxy.remote.exit_now(7)
    proxy.close()  # closing a dead one is quiet


def test_the_service_implements_the_rollout_protocol() -> None:
    def methods(protocol: type) -> set[str]:
        return {n for n in vars(protocol) if not n.startswith("_")}

    control = methods(RolloutControl)
    assert control >= {"start", "membership", "synced", "take_out", "explain", "close"}
    for name in control:
        expected = inspect.signature(getattr(RolloutControl, name))
        actual = inspect.signature(getattr(RolloutService, name))
        assert list(actual.parameters)[: len(expected.parameters)] == list(expected.parameters)
        assert actual.return_annotation == expected.return_annotation, name
    for name in methods(RunRollout):
        assert callable(getattr(RolloutHost, name)), name
