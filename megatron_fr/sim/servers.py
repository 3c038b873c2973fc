"""Simulated inference servers: batched decoding as processor sharing, and the client's
least-outstanding-requests routing (engine/client.py `_pick`).

Every running request of a server decodes at the same speed r(c) (sim/costs.py DecodeModel,
c = running requests), so rather than track each request the server keeps one clock,
`progress`: tokens decoded by any request that ran from the start. A request that starts at
progress P with n tokens to go finishes when progress reaches P + n; the running requests sit
in a heap keyed by that mark, and the next completion is (mark - progress) / r(c) seconds
away while nothing changes. Starting, finishing, pausing or prefilling changes r, so the
server is brought up to date (`advance`) before each change and its next completion is then
scheduled anew (an `epoch` tells stale completion events apart).

Prefill is modelled as a stall: while a server prefills it decodes nothing (prefill batches
take the GPU between decode iterations).
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field

from megatron_fr.sim.costs import DecodeModel


@dataclass
class Request:
    """One rollout while it generates; continues on another server after a weight sync."""

    rollout_id: str
    prompt_tokens: int
    response_tokens: int
    decoded: float = 0.0
    """Tokens decoded in earlier segments (before weight syncs)."""
    first_version: int | None = None
    """Version of the oldest generated token; set when the request first decodes."""
    started_at_progress: float = 0.0
    decoded_by_version: list[tuple[int, float]] = field(default_factory=list)
    """(version, tokens decoded by its end) at each weight sync the request was decoding
    across: which of its tokens mask_stale_tokens makes context when it is trained."""

    @property
    def remaining(self) -> float:
        return self.response_tokens - self.decoded


class DecodeServer:
    def __init__(
        self, index: int, decode: DecodeModel, max_running: int, prefill_tokens_per_s: float | None
    ) -> None:
        self.index, self.decode, self.max_running = index, decode, max_running
        self.prefill_tokens_per_s = prefill_tokens_per_s
        self.progress = 0.0
        self.updated_at = 0.0
        self.stalled_until = 0.0
        self.paused = False
        self.epoch = 0
        self._running: list[tuple[float, int, Request]] = []
        self._waiting: deque[Request] = deque()
        self._order = 0
        self.decoded_tokens = 0.0
        """Tokens decoded since the start (all requests)."""
        self.busy_s = 0.0
        """Seconds spent decoding at least one request."""
        self.running_s = 0.0
        """Integral of running requests over time (mean concurrency = running_s / time)."""

    @property
    def outstanding(self) -> int:
        return len(self._running) + len(self._waiting)

    def advance(self, now: float) -> None:
        """Bring progress and the usage integrals up to `now`."""
        start = max(self.updated_at, self.stalled_until)
        running = len(self._running)
        if not self.paused and running and now > start:
            elapsed = now - start
            self.progress += self.decode.tokens_per_s(running) * elapsed
            self.decoded_tokens += self.decode.tokens_per_s(running) * elapsed * running
            self.busy_s += elapsed
            self.running_s += elapsed * running
        self.updated_at = now

    def add(self, request: Request, now: float, version: int) -> None:
        self.advance(now)
        if len(self._running) < self.max_running:
            self._start(request, now, version)
        else:
            self._waiting.append(request)

    def _start(self, request: Request, now: float, version: int) -> None:
        if self.prefill_tokens_per_s is not None:
            context = request.prompt_tokens + request.decoded
            self.stalled_until = max(now, self.stalled_until) + context / self.prefill_tokens_per_s
        if request.first_version is None:
            request.first_version = version
        request.started_at_progress = self.progress
        self._order += 1
        heapq.heappush(self._running, (self.progress + request.remaining, self._order, request))

    def next_completion(self, now: float) -> float | None:
        """When the next running request finishes if nothing changes; None: none will."""
        if self.paused or not self._running:
            return None
        mark = self._running[0][0]
        rate = self.decode.tokens_per_s(len(self._running))
        return max(now, self.stalled_until) + max(mark - self.progress, 0.0) / rate

    def finish_next(self, now: float, version: int) -> Request:
        """Remove the request whose completion is due now; a waiting one takes its place."""
        self.advance(now)
        mark, _, request = heapq.heappop(self._running)
        self.progress = max(self.progress, mark)  # the event time rounds; the mark is exact
        request.decoded = request.response_tokens
        if self._waiting:
            self._start(self._waiting.popleft(), now, version)
        return request

    def abort_all(self, now: float) -> list[Request]:
        """Pause for a weight sync: every request ends its segment, keeping what it decoded
        (weights.pause_mode "abort"; the client continues each under the new version)."""
        self.advance(now)
        requests = []
        for _, _, request in sorted(self._running, key=lambda item: item[1]):
            request.decoded += self.progress - request.started_at_progress
            if request.decoded < 1.0:  # no token yet: its first one will be of the new version
                request.decoded, request.first_version = 0.0, None
            requests.append(request)
        requests.extend(self._waiting)
        self._running, self._waiting = [], deque()
        self.paused = True
        return requests

    def resume(self, now: float) -> None:
        self.updated_at = now
        self.stalled_until = min(self.stalled_until, now)
        self.paused = False


class Dispatcher:
    """Least outstanding requests first, then least sent (engine/client.py `_pick`), with a
    heap of (outstanding, sent, index) entries; entries made stale by a change are skipped."""

    def __init__(self, servers: list[DecodeServer]) -> None:
        self.servers = servers
        self._sent = [0] * len(servers)
        self._stamp = [0] * len(servers)
        self._heap = [(0, 0, i, 0) for i in range(len(servers))]

    def pick(self) -> DecodeServer:
        while True:
            outstanding, _, index, stamp = heapq.heappop(self._heap)
            if stamp == self._stamp[index]:
                break
        self._sent[index] += 1
        self._refresh(index, outstanding + 1)
        return self.servers[index]

    def update(self, server: DecodeServer) -> None:
        """After a request left `server` (finished, or aborted for a weight sync)."""
        self._refresh(server.index, server.outstanding)

    def _refresh(self, index: int, outstanding: int) -> None:
        self._stamp[index] += 1
        heapq.heappush(self._heap, (outstanding, self._sent[index], index, self._stamp[index]))
