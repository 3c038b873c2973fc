"""The rule every inference engine's URL follows, wherever it is written: the recipe's
rollout.engine.urls (refused by the config, so `--check` names it) and the live
RUN_DIR/engines.txt (a line left out, rollout/engines_file.py).

An engine is a server's root, ``http(s)://HOST:PORT``: a path, a query, a user, a missing
port (``http://host`` would be port 80, which no engine listens on by default), another
scheme (``file:///etc/passwd``), spaces or control characters (a newline in a YAML string)
are each a problem named at once, never a connection error minutes later.
"""

from __future__ import annotations

from urllib.parse import urlsplit

URL_FORM = "write each engine as http(s)://HOST:PORT"
"""The remedy for a URL that url_problem refuses."""


def url_problem(url: str) -> str | None:
    """Why `url` cannot be an inference engine's address, None when it can."""
    if not url:
        return "is empty"
    if not url.isprintable() or any(character.isspace() for character in url):
        return "holds spaces or control characters"
    try:
        parts = urlsplit(url)
        port = parts.port  # raises on a port that is not a number in 0..65535
    except ValueError as error:
        return f"is not a URL ({error})"
    if parts.scheme not in ("http", "https"):
        return "is not an http(s) URL"
    if not parts.hostname:
        return "names no host"
    if not port:
        return "names no port"
    if parts.path not in ("", "/") or parts.query or parts.fragment or parts.username:
        return "is not a server's root URL (it has a path, a query or a user)"
    return None


def root_url(url: str) -> str:
    """`url` (checked by url_problem) as ``scheme://host:port``, the host lower-case."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    host = f"[{host}]" if ":" in host else host
    return f"{parts.scheme}://{host}:{parts.port}"
