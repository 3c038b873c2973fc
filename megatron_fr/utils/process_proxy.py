"""An object served in a process of its own, called through a proxy typed as its protocol.

    caller                                        child process (spawned; dies with its parent)
    ProcessProxy(Protocol, build, args)           target = build(*args)
      .remote.method(*args)  ── pipe: (method, args) ──►  target.method(*args)
                             ◄── ("ok", value) | ("raise", exception) ──

`remote` is typed as the protocol, so every call keeps its signature and return type, and only
the protocol's methods are forwarded: any other name is refused on the caller's side before
anything is sent. An exception the target raises arrives as itself (its class and message, with
the child's traceback as a note), pickled; one that does not survive pickling arrives as
RemoteError carrying its class name, message and traceback. A child that died (its pipe closed)
or did not answer within a call's timeout is ProcessDied, so a caller tells the target's own
errors from the loss of the process.

Calls are answered one at a time, in order. `after_reply` runs in the child after each answer
is sent: work the caller must have its answer before (a send its own rank receives).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import pickle
import traceback
from collections.abc import Callable, Mapping
from multiprocessing.connection import Connection
from typing import Any, Generic, Protocol, TypeVar, cast


class Served(Protocol):
    """What a served object needs besides its protocol's methods: a way to stop."""

    def close(self) -> None: ...


P = TypeVar("P", bound=Served)
log = logging.getLogger("megatron_fr.process_proxy")


class ProcessDied(RuntimeError):
    """The served process exited, or did not answer a call within its timeout."""


class RemoteError(RuntimeError):
    """An exception of the served object that could not be pickled: its class name, message
    and traceback, as text."""


class ProcessProxy(Generic[P]):
    """The caller's handle on a process serving `build(*args)`: `remote` calls its methods,
    `close` stops it. Made as ProcessProxy[Protocol](Protocol, build, ...): the type argument
    types `remote` and checks `build` (a protocol is no concrete type[P]), the argument names
    the methods to forward."""

    def __init__(
        self,
        protocol: type,
        build: Callable[..., P],
        args: tuple,
        *,
        name: str,
        ready_timeout_s: float,
        timeouts: Mapping[str, float] | None = None,
        after_reply: Callable[[Any], None] | None = None,
    ) -> None:
        self.name = name
        self.methods = protocol_methods(protocol)
        self.timeouts = dict(timeouts or {})
        context = mp.get_context("spawn")
        self._pipe, child = context.Pipe()
        self.process = context.Process(
            target=_serve,
            args=(child, build, args, self.methods, name, after_reply),
            name=f"megatron-fr-{name.replace(' ', '-')}",
            daemon=False,
        )
        self.process.start()
        child.close()
        try:
            self._answer("build", ready_timeout_s)
        except BaseException:
            self.close()  # no handle is returned to close it later
            raise
        self.remote = cast(P, _Forwarder(self, protocol.__name__))

    def call(self, method: str, args: tuple) -> Any:
        """`method(*args)` in the child, its value or its exception here."""
        if method not in self.methods:
            raise AttributeError(f"{method} is not a method the {self.name} serves")
        try:
            self._pipe.send((method, args))
        except (BrokenPipeError, ConnectionResetError):
            raise self._died(method) from None
        return self._answer(method, self.timeouts.get(method))

    def _answer(self, method: str, timeout_s: float | None) -> Any:
        try:
            if timeout_s is not None and not self._pipe.poll(timeout_s):
                raise ProcessDied(f"{self.name}: no answer to {method} within {timeout_s:.0f} s")
            status, value = self._pipe.recv()
        except (EOFError, BrokenPipeError, ConnectionResetError):
            raise self._died(method) from None
        if status == "raise":
            raise value
        return value

    def _died(self, method: str) -> ProcessDied:
        self.process.join(timeout=5)
        return ProcessDied(
            f"the {self.name} (pid {self.process.pid}) exited with code "
            f"{self.process.exitcode} during {method}"
        )

    def close(self) -> None:
        """Ask the served object to close, then end the process; idempotent. Best effort: the
        process ends whatever the served close raised (logged)."""
        if self.process.is_alive() and "close" in self.methods:
            try:
                self.call("close", ())
            except ProcessDied:
                pass
            except Exception as error:
                log.warning("closing what the %s serves failed: %r", self.name, error)
        self.process.join(timeout=30)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self._pipe.close()


class _Forwarder:
    """`remote`: an attribute of the protocol is a function that calls it in the child."""

    def __init__(self, proxy: ProcessProxy, protocol_name: str) -> None:
        self._proxy, self._protocol_name = proxy, protocol_name

    def __getattr__(self, method: str) -> Callable[..., Any]:
        if method not in self._proxy.methods:
            raise AttributeError(
                f"{method} is not a method of {self._protocol_name}: the proxy forwards only those"
            )
        return lambda *args: self._proxy.call(method, args)


def protocol_methods(protocol: type) -> frozenset[str]:
    """The public methods a protocol declares, its bases' included."""
    return frozenset(
        name
        for klass in protocol.__mro__
        if klass not in (object, Protocol, Generic)
        for name, value in vars(klass).items()
        if callable(value) and not name.startswith("_")
    )


def _serve(
    pipe: Connection,
    build: Callable[..., Served],
    args: tuple,
    methods: frozenset[str],
    name: str,
    after_reply: Callable[[Any], None] | None,
) -> None:
    from megatron_fr.utils.parent_watch import exit_when_parent_dies

    exit_when_parent_dies()
    try:
        target = build(*args)
    except Exception as error:
        pipe.send(_raised(error, name))
        return
    pipe.send(("ok", None))
    try:
        while True:
            method, call_args = pipe.recv()
            try:
                if method not in methods:
                    raise AttributeError(f"{method} is not a method the {name} serves")
                reply = ("ok", getattr(target, method)(*call_args))
            except Exception as error:  # the caller decides what the target's error means
                reply = _raised(error, name)
            pipe.send(reply)
            if after_reply is not None and reply[0] == "ok":
                after_reply(target)
            if method == "close":
                return
    except (EOFError, KeyboardInterrupt):
        target.close()


def _raised(error: Exception, name: str) -> tuple[str, BaseException]:
    """The exception as the caller will raise it: itself with the child's traceback as a
    note, or RemoteError when it does not survive pickling."""
    where = f"raised in the {name} (pid {os.getpid()}):\n{traceback.format_exc()}"
    try:
        error.add_note(where)
        pickle.loads(pickle.dumps(error))
    except Exception:
        return ("raise", RemoteError(f"{type(error).__qualname__}: {error}\n{where}"))
    return ("raise", error)
