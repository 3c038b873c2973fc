"""Socket helpers, free of torch so that HTTP-only modules can use them.

Which of this machine's addresses faces another host: what a process that hosts a group
tells its peers, and what it binds its own end to, so that nothing depends on what the host
name resolves to (127.0.1.1 on many distributions). And a free loopback port, for a group or
a server started on this machine."""

from __future__ import annotations

import ipaddress
import socket


def address_towards(host: str) -> str:
    """This machine's address on the interface that routes to `host` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((socket.gethostbyname(host), 9))
        except OSError as error:
            raise OSError(f"no route from this host to host {host!r}: {error}") from error
        return probe.getsockname()[0]


def is_this_host(host: str) -> bool:
    """Whether `host` is this machine: a loopback address, or one the kernel routes to from
    this machine's own address of that name (no packet is sent)."""
    try:
        address = socket.gethostbyname(host)
        return ipaddress.ip_address(address).is_loopback or address_towards(address) == address
    except (OSError, ValueError):
        return False


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
