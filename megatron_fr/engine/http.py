"""Blocking JSON calls to an inference engine's control endpoints, each with a deadline.

Weight sync runs on learner ranks between optimizer steps, where a plain blocking call with a
timeout is simpler than an event loop; every failure names the URL, the endpoint and why.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any


class EngineRequestError(RuntimeError):
    """An engine did not answer, answered an error, or answered something unreadable."""


def post_json(url: str, path: str, body: dict | None, timeout_s: float) -> Any:
    data = json.dumps(body or {}).encode()
    request = urllib.request.Request(
        url.rstrip("/") + path, data=data, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            text = response.read().decode()
    except urllib.error.HTTPError as error:
        detail = error.read().decode(errors="replace")[:500]
        raise EngineRequestError(f"{url}{path}: HTTP {error.code}: {detail}") from error
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


def post_all(urls: list[str], path: str, body: dict | None, timeout_s: float) -> list[Any]:
    """The same call to every engine at once; raises the first failure after all finished."""
    with ThreadPoolExecutor(max_workers=max(1, len(urls))) as pool:
        futures = [pool.submit(post_json, url, path, body, timeout_s) for url in urls]
    return [future.result() for future in futures]
