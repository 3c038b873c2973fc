"""RUN_DIR/engines.txt read as input from outside the run: whatever is written there, a line
that cannot name an engine is left out with the reason, and the run goes on.

The file is written by hand or by a script while the run trains, so it can hold anything: a
URL cut short (``http://[::1``), bytes that are not text, a name written twice. It is read
only when it changed (its inode, size or modification time), only if it is a regular file
(a directory or a FIFO is refused without being opened: reading a FIFO waits for a writer),
and at most MAX_BYTES of it. Each line must be an engine's root URL, ``http(s)://HOST:PORT``,
by the rule the recipe's rollout.engine.urls follow (utils/engine_urls.py); a line that is
not, or that names the same scheme, host and port as an earlier line, is one problem naming
the file, the line and the remedy. Whether a good line names an engine already in the pool
under another spelling (``localhost`` for ``127.0.0.1``) is decided by the supervisor, which
knows the pool (rollout/supervisor.py).
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from megatron_fr.utils.engine_urls import URL_FORM, root_url, url_problem

MAX_BYTES = 65536
"""How much of the file is read (a thousand URLs fit)."""


@dataclass
class Listing:
    """What one reading of the file found."""

    urls: list[str] = field(default_factory=list)
    """Well-formed engine URLs, each once, in the file's order (``scheme://host:port``)."""
    problems: list[str] = field(default_factory=list)
    """One line per thing left out, naming the file (and line) and the remedy."""


class EnginesFile:
    """The engines file of one run, read when it changed."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._seen: tuple[int, ...] | None = None

    def changed(self) -> Listing | None:
        """The file's listing when it changed since the last call (module docstring); None
        when it did not, or is absent."""
        try:
            status = os.stat(self.path)
        except FileNotFoundError:
            self._seen = None
            return None
        except OSError as error:
            return self._once((error.errno or 0,), f"{self.path}: unreadable ({error.strerror})")
        seen = (status.st_mode, status.st_ino, status.st_size, status.st_mtime_ns)
        if seen == self._seen:
            return None
        self._seen = seen
        if not stat.S_ISREG(status.st_mode):
            return Listing(problems=[f"{self.path}: {_not_regular(status.st_mode)}"])
        try:
            data = _read_regular(self.path)
        except OSError as error:
            return Listing(problems=[f"{self.path}: unreadable ({error.strerror or error})"])
        return self._parse(data)

    def _once(self, seen: tuple[int, ...], problem: str) -> Listing | None:
        if seen == self._seen:
            return None
        self._seen = seen
        return Listing(problems=[problem])

    def _parse(self, data: bytes) -> Listing:
        listing, first_line = Listing(), dict[str, int]()
        if len(data) > MAX_BYTES:
            listing.problems.append(f"{self.path}: past {MAX_BYTES} bytes; the rest is left out")
            data = data[:MAX_BYTES]
        for number, raw in enumerate(data.split(b"\n"), start=1):
            where = f"{self.path}:{number}"
            try:
                line = raw.decode("utf-8").strip()
            except UnicodeDecodeError:
                listing.problems.append(f"{where}: not UTF-8 text; left out (one URL a line)")
                continue
            if not line or line.startswith("#"):
                continue
            problem = url_problem(line)
            if problem is not None:
                listing.problems.append(f"{where}: {line[:120]!r} {problem}; left out ({URL_FORM})")
                continue
            url = root_url(line)
            if url in first_line:
                listing.problems.append(
                    f"{where}: {url} is listed already on line {first_line[url]}; left out"
                )
                continue
            first_line[url] = number
            listing.urls.append(url)
        return listing


def _read_regular(path: Path) -> bytes:
    """Up to MAX_BYTES + 1 bytes of `path`, opened without blocking and read only if it is
    still a regular file once open (it may have been replaced since it was looked at)."""
    descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        mode = os.fstat(descriptor).st_mode
        if not stat.S_ISREG(mode):
            raise OSError(f"{_not_regular(mode)}")
        return os.read(descriptor, MAX_BYTES + 1)
    finally:
        os.close(descriptor)


def _not_regular(mode: int) -> str:
    kind = "a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "special"
    return (
        f"not a regular file ({kind}); left unread: write the engines' URLs in a plain file, "
        "one a line"
    )
