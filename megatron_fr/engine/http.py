"""Blocking JSON calls to an inference engine's control endpoints, each with a deadline.

Weight sync runs on learner ranks between optimizer steps, where a plain blocking call with a
timeout is simpler than an event loop; every failure names the URL, the endpoint and why.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

FLUSH_CACHE_PATH = "/flush_cache"
SERVER_INFO_PATH = "/server_info"
MODEL_INFO_PATH = "/model_info"


class EngineRequestError(RuntimeError):
    """An engine did not answer, answered an error, or answered something unreadable.
    `status` is the HTTP status when the engine answered one."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


def _call(url: str, path: str, data: bytes | None, timeout_s: float) -> Any:
    headers = {"Content-Type": "application/json"} if data is not None else {}
    request = urllib.request.Request(url.rstrip("/") + path, data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            text = response.read().decode()
    except urllib.error.HTTPError as error:
        detail = error.read().decode(errors="replace")[:500]
        raise EngineRequestError(f"{url}{path}: HTTP {error.code}: {detail}", error.code) from error
    except (urllib.error.URLError, TimeoutError, OSError) as error:
        reason = getattr(error, "reason", error)
        raise EngineRequestError(
            f"{url}{path}: no answer within {timeout_s:g} s ({reason})"
        ) from error
    try:
        answer = json.loads(text) if text.strip().startswith(("{", "[")) else text
    except json.JSONDecodeError as error:
        raise EngineRequestError(f"{url}{path}: unreadable answer {text[:200]!r}") from error
    if isinstance(answer, dict) and answer.get("success") is False:
        raise EngineRequestError(f"{url}{path}: {answer.get('message', answer)}")
    return answer


def post_json(url: str, path: str, body: dict | None, timeout_s: float) -> Any:
    return _call(url, path, json.dumps(body or {}).encode(), timeout_s)


def get_json(url: str, path: str, timeout_s: float) -> Any:
    return _call(url, path, None, timeout_s)


def post_all(urls: list[str], path: str, body: dict | None, timeout_s: float) -> list[Any]:
    """The same call to every engine at once; raises the first failure after all finished."""
    with ThreadPoolExecutor(max_workers=max(1, len(urls))) as pool:
        futures = [pool.submit(post_json, url, path, body, timeout_s) for url in urls]
    return [future.result() for future in futures]


def flush_cache(url: str, timeout_s: float, retry_s: float = 0.5) -> None:
    """Empty SGLang's prefix (radix) cache, so no KV computed by old weights is reused. SGLang
    answers 400 while requests are running or queued (Scheduler.flush_cache; a paused engine's
    waiting queue does not count)."""
    flush_while_busy(url, FLUSH_CACHE_PATH, timeout_s, lambda e: e.status == 400, retry_s)


def flush_while_busy(
    url: str,
    path: str,
    timeout_s: float,
    busy: Callable[[EngineRequestError], bool],
    retry_s: float = 0.5,
) -> None:
    """POST `path` to empty an engine's prefix cache, asked again while its refusal says it is
    still busy (`busy`) until `timeout_s` has passed; then the refusal, saying so."""
    deadline = time.monotonic() + timeout_s
    while True:
        remaining = deadline - time.monotonic()
        try:
            post_json(url, path, None, max(remaining, 0.1))
            return
        except EngineRequestError as error:
            if not busy(error) or remaining <= retry_s:
                raise EngineRequestError(
                    f"{url}{path}: cache not flushed within {timeout_s:g} s "
                    f"(requests still running?): {error}",
                    error.status,
                ) from error
        time.sleep(retry_s)
