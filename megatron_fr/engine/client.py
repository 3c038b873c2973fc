"""Rollout client: turns one prompt into exactly one finished Rollout over several SGLang servers.

    generate(prompt) ─► pick server (session sticky, else least outstanding requests)
                          │ POST /generate (rid.<segment>.<attempt>)
            connection error / 5xx ────────────► mark server down, retry on another server
            timeout (the server is slow) ──────► halve its in-flight limit, retry (the server
                                                 is not marked down nor counted as failing)
            server taken out of the pool ──────► its in-flight requests retried on another
            4xx / malformed response ──────────► raise (naming the server and the field)
                          │ finish_reason "abort" (server paused for a weight update)
                          └─► re-submit prompt + tokens so far, budget reduced

Every token keeps the weight version the server reports for it (SGLang's per-token
meta_info.weight_versions spans), so a segment that straddles an in-place update, and a
continuation after an abort, both carry the version of the weights that sampled each token.

Routed experts (MoE routing replay, config.routed_experts): each segment asks for the positions
not reported yet (routed_experts_start_len = the first of them), so the segments of a call, and
the calls of a multi-turn row (generate's routed_experts_from), tile the row's positions once,
each with the routing the engine used when it first fed that position. A request a weight
sync aborts while it is still in SGLang's waiting queue comes back with no token and no routed
experts (TokenizerManager._handle_abort_req attaches none): it reported nothing, so it is
continued like any abort. A server that sends none for a segment that did generate ends the
run (RoutedExpertsUnavailable): it is misconfigured, and a retry would not help.

Top-K log-probs (config.top_logprobs = K, for the top-K gate): every segment asks for them
(SGLang's top_logprobs_num) and the Rollout carries one row per output token, the segments'
rows in order, so a continued rollout's rows are those of the engines that sampled each token.
A server that sends null for some tokens (SGLang's rows for tokens it has no top-K of) ends
the run (TopLogProbsUnavailable), as missing routed experts do: the gate cannot be fed.

The pool changes while the run goes on (rollout/supervisor.py): take_out(url) ends the
requests in flight on that server at once (each is retried on the others with the prompt and
the tokens kept so far) and sends it nothing more; admit(url) adds a server, or brings one
back, once it serves the current weights. With no server in the pool a segment fails as when
all are down (ServersUnavailable: the group is re-issued after a backoff).

Slow is not dead: a timeout is back-pressure from a server that may still be answering, so it
lowers that server's limit on requests in flight (multiplicative decrease to half of those in
flight, a floor of 1; each success adds 1/limit back, up to max_in_flight) and the segment is
retried without using one of its max_attempts; requests over the limit wait in the client,
where they count neither as in flight nor as stalled. Only connection errors, 5xx and a server
leaving the pool count toward `failing(url)`, which the pool's watch reads to take a server out;
a server that makes no progress at all is the watch's to find (`stalled_s`: no answer for a
while, timeouts included, after which the watch probes it: rollout/supervisor.py).

Invariant: each generate call yields one Rollout or raises one exception; a retried or
continued segment replaces nothing already kept, so no request is lost or counted twice.
Use: `async with RolloutClient(RolloutClientConfig(urls=[...])) as c: await c.generate(ids, sp)`
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import Counter
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import numpy as np
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    field_validator,
)

from megatron_fr.config.algo import MAX_GATE_TOP_K
from megatron_fr.engine.backends import backend_for
from megatron_fr.engine.routing import RoutedExperts
from megatron_fr.engine.server_info import EngineKind
from megatron_fr.engine.sglang.protocol import decode_routed_experts
from megatron_fr.engine.top_logprobs import TopLogProbs
from megatron_fr.engine.types import (
    HEALTH_PATH,
    FinishReason,
    GenerateOutput,
    MalformedResponse,
    RoutedExpertsLayout,
    SamplingParams,
)


class RolloutClientConfig(BaseModel):
    """Where the servers are and how hard to try each request."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    urls: tuple[str, ...] = Field(min_length=1)
    """Base URLs of the servers, e.g. "http://node3:30000"."""
    engine_kind: EngineKind = "sglang"
    """What serves them: the wire the client speaks (engine/wire.py; "cpu" speaks SGLang's)."""
    request_timeout_s: PositiveFloat = 600.0
    """Whole-request limit. A request sent to a paused server waits for the weight update, so
    this must cover one update plus the longest generation."""
    connect_timeout_s: PositiveFloat = 10.0
    """TCP connect limit: how fast an unreachable server is given up on."""
    max_attempts: PositiveInt = 3
    """Tries per segment (first try included) that failed on connection error or 5xx before
    the call fails; timeouts are counted apart (max_timeouts)."""
    max_timeouts: PositiveInt = 16
    """Timeouts per segment before the call fails: each lowered the server's in-flight limit
    and was retried; so many in a row means no server can serve the request in time."""
    max_in_flight: PositiveInt = 1024
    """Most requests in flight per server; timeouts lower a server's limit below it."""
    server_cooldown_s: NonNegativeFloat = 30.0
    """How long a server that failed is avoided (it is still used when no other is left)."""
    max_continuations: NonNegativeInt = 8
    """Re-submissions after finish_reason "abort"; past it the partial Rollout is returned as
    "abort"."""
    routed_experts: RoutedExpertsLayout | None = None
    """Ask the servers for the routed experts of every position (MoE routing replay in the
    learner), checked against this layout of the model; None: not asked. SGLang sends them
    only when launched with --enable-return-routed-experts."""
    top_logprobs: int = Field(default=0, ge=0, le=MAX_GATE_TOP_K)
    """K: ask for the K most likely tokens, with their log-probs, of every generated token's
    distribution (the top-K gate's input; SGLang's top_logprobs_num); 0: not asked."""

    @field_validator("urls")
    @classmethod
    def _http_urls(cls, urls: tuple[str, ...]) -> tuple[str, ...]:
        cleaned = tuple(url.rstrip("/") for url in urls)
        for i, url in enumerate(cleaned):
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"urls[{i}] must start with http:// or https://, got {url!r}")
        if len(set(cleaned)) != len(cleaned):
            raise ValueError(f"urls has duplicates: {list(cleaned)}")
        return cleaned


@dataclass(frozen=True)
class Rollout:
    """One finished generation: what the learner stores with the trajectory."""

    rid: str
    """The call's id; each POST carries "<rid>.<continuation>.<attempt>" as SGLang's rid."""
    prompt_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]
    """Behavior log-prob of each output token, as the server reported it when sampling."""
    token_versions: list[str]
    """The version of the weights that sampled each output token, as the server reported it."""
    finish_reason: FinishReason
    routed_experts: RoutedExperts | None
    """The experts each position of prompt_ids + output_ids was routed to, from position
    `routed_experts_from` (generate's argument) on: to the last but one token, or fewer when no
    token was generated; None unless the config asks for them."""
    server: str
    """The server that produced the last segment."""
    attempts: int
    """POST /generate sent for this rollout, over all segments and retries."""
    continuations: int
    top_logprobs: TopLogProbs | None = None
    """The top-K ids and log-probs of each output token's distribution, one row per output
    token; None unless the config asks for them."""


@dataclass
class ClientMetrics:
    """Counters since the client was created (read them; the client alone writes them)."""

    requests: Counter[str] = field(default_factory=Counter)
    """POST /generate sent, per server."""
    failures: Counter[str] = field(default_factory=Counter)
    """Failed POST /generate (any reason, timeouts included), per server."""
    timeouts: Counter[str] = field(default_factory=Counter)
    """POST /generate that timed out, per server."""
    retries: int = 0
    continuations: int = 0


KEEPALIVE_S = 4.0
"""How long an idle connection to a server is kept for reuse: below the servers' own keep-alive
(SGLang's uvicorn closes idle connections after SGLANG_TIMEOUT_KEEP_ALIVE, 5 s; vLLM's after
VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s). aiohttp's default, 15 s, reused connections the server
had closed while the engine sat idle (a learner step of 5-15 s with the buffer full): each
such request failed ("Server disconnected"), and 18 in a row took a healthy SGLang engine out
of the pool."""


class RolloutError(RuntimeError):
    """A generate call that could not produce a Rollout."""


class RequestRejected(RolloutError):
    """A server answered 4xx: the request itself is wrong, so retrying elsewhere would not help."""


class ServersUnavailable(RolloutError):
    """Every attempt failed on connection error, timeout or 5xx."""


class RoutedExpertsUnavailable(RuntimeError):
    """Routed experts were asked for and the server sent none: not a failed rollout but a
    misconfigured run (SGLang without --enable-return-routed-experts, or a dense model)."""


class TopLogProbsUnavailable(RuntimeError):
    """Top-K log-probs were asked for and the server sent null for some output tokens (SGLang
    has none for them): not a failed rollout but a run whose top-K gate cannot be fed."""


class _Retryable(Exception):
    """A failure of the server, not of the request."""


class _Timeout(_Retryable):
    """The request had no answer within request_timeout_s: the server may be slow, not dead."""


@dataclass
class _Server:
    url: str
    limit: float
    """Requests it may have in flight (AIMD, module docstring); int(limit) of them."""
    outstanding: int = 0
    """Requests in flight at it."""
    waiting: int = 0
    """Requests waiting in the client for it to have fewer than its limit in flight."""
    sent: int = 0
    down_until: float = 0.0
    failing: int = 0
    """Requests in a row that failed on the server's side (connection, 5xx, taken out);
    timeouts neither count nor reset it."""
    lowered_at: float = 0.0
    """When its limit was last lowered: a timeout of a request sent before then lowers it no
    further (the requests in flight then were already counted)."""
    freed: asyncio.Event | None = None
    """Set (and dropped) when a request in flight ends, the limit rises or the server leaves
    the pool: what the requests waiting for a slot wait on."""
    progress_at: float = 0.0
    """When its requests in flight last moved: its last answer to a /generate, the moment it
    got work with nothing in flight (unless its last request timed out: a wedged engine's
    requests all time out, and the clock must run on across their retries), or the moment
    the pool's probe saw it generate (progressed()); time.monotonic()."""
    timed_out_last: bool = False
    """Its last request to end timed out (no answer since): the clock is not restarted when
    its next request is sent."""
    taken_out: asyncio.Event | None = None
    """Set when the server leaves the pool; its requests in flight wait on it too. Made on
    first use, inside the client's loop."""

    def out_event(self) -> asyncio.Event:
        if self.taken_out is None:
            self.taken_out = asyncio.Event()
        return self.taken_out

    @property
    def in_pool(self) -> bool:
        return self.taken_out is None or not self.taken_out.is_set()

    @property
    def queued(self) -> int:
        return self.outstanding + self.waiting

    def wake(self) -> None:
        """Let the requests waiting for a slot look again."""
        if self.freed is not None:
            self.freed.set()
            self.freed = None

    async def acquire(self) -> None:
        """Wait until the server has a slot under its limit and take it; _Retryable when it
        leaves the pool first."""
        self.waiting += 1
        try:
            while self.in_pool and self.outstanding >= int(self.limit):
                if self.freed is None:
                    self.freed = asyncio.Event()
                await self.freed.wait()
        finally:
            self.waiting -= 1
        if not self.in_pool:
            raise _Retryable(f"{self.url} was taken out of the pool")
        if not self.outstanding and not self.timed_out_last:
            self.progress_at = time.monotonic()
        self.outstanding += 1

    def release(self) -> None:
        self.outstanding -= 1
        self.wake()

    def slowed(self, sent_at: float) -> None:
        """A request sent at `sent_at` timed out: halve the requests in flight."""
        if sent_at >= self.lowered_at:
            self.limit = max(1.0, min(self.limit, self.outstanding) / 2)
            self.lowered_at = time.monotonic()

    def served(self, most: int) -> None:
        """A request was answered: the limit grows by one per limit's worth of answers."""
        if self.limit < most:
            self.limit = min(float(most), self.limit + 1 / self.limit)
            self.wake()


class RolloutClient:
    """Least-outstanding-requests client over `config.urls` (one per server)."""

    def __init__(self, config: RolloutClientConfig) -> None:
        self.config = config
        self.metrics = ClientMetrics()
        self._wire = backend_for(config.engine_kind).wire
        self._servers = {url: self._new_server(url) for url in config.urls}
        self._sessions: dict[str, str] = {}
        self._http: aiohttp.ClientSession | None = None
        self._timeout = aiohttp.ClientTimeout(
            total=config.request_timeout_s, sock_connect=config.connect_timeout_s
        )

    async def __aenter__(self) -> RolloutClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()
            self._http = None

    def _session(self) -> aiohttp.ClientSession:
        # Created on first use: aiohttp binds a session to the running event loop.
        if self._http is None:
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S)
            self._http = aiohttp.ClientSession(connector=connector)
        return self._http

    def _new_server(self, url: str) -> _Server:
        return _Server(url, limit=float(self.config.max_in_flight))

    @property
    def urls(self) -> list[str]:
        """Every server the client has known, in the order it learnt of them, in the pool or
        not (the order of the per-engine metrics)."""
        return list(self._servers)

    def failing(self, url: str) -> int:
        """Requests to `url` in a row that failed on its side (0 for a server never used)."""
        server = self._servers.get(url)
        return server.failing if server is not None else 0

    def in_flight_limit(self, url: str) -> int:
        """Requests `url` may have in flight now (lowered by its timeouts)."""
        server = self._servers.get(url)
        return int(server.limit) if server is not None else self.config.max_in_flight

    def stalled_s(self, url: str) -> float:
        """Seconds the requests in flight at `url` have gone without an answer (_Server.
        progress_at); 0 with nothing in flight: an idle server is never stalled."""
        server = self._servers.get(url)
        if server is None or not server.outstanding:
            return 0.0
        return time.monotonic() - server.progress_at

    def progressed(self, url: str) -> None:
        """`url` was seen to generate (the pool's probe answered): its stall clock restarts.
        Called in the client's loop."""
        server = self._servers.get(url)
        if server is not None:
            server.progress_at, server.timed_out_last = time.monotonic(), False

    def in_pool(self, url: str) -> bool:
        server = self._servers.get(url)
        return server is not None and server.in_pool

    def take_out(self, url: str) -> None:
        """Send `url` nothing more and end its requests in flight now (each is retried on
        another server). Called in the client's loop."""
        server = self._servers[url]
        server.out_event().set()
        server.wake()

    def admit(self, url: str) -> None:
        """Serve from `url`: a new server, or one taken out that is back. Called in the
        client's loop."""
        server = self._servers.setdefault(url, self._new_server(url))
        server.taken_out, server.down_until, server.failing = None, 0.0, 0
        server.timed_out_last = False
        server.limit = float(self.config.max_in_flight)  # a new process, or one back

    def end_session(self, session_id: str) -> None:
        """Forget a finished multi-turn session's server (the map would otherwise only grow)."""
        self._sessions.pop(session_id, None)

    async def generate(
        self,
        input_ids: list[int],
        sampling: SamplingParams,
        *,
        session_id: str | None = None,
        behavior_correction: bool = False,
        rid: str | None = None,
        routed_experts_from: int = 0,
    ) -> Rollout:
        """Generate up to `sampling.max_new_tokens` tokens after `input_ids`.

        `routed_experts_from`: the first position whose routed experts the Rollout carries
        (when the config asks for them); a multi-turn row passes the positions its earlier
        turns reported, so its turns tile the row.

        `behavior_correction=True` means the learner will weight tokens by the returned
        log-probs, which SGLang computes before top-p/top-k truncation: such sampling is refused
        before anything is sent. `session_id` keeps the turns of one conversation on one server
        (its prefix cache) while that server is up. The Rollout's finish_reason is "abort" only
        when `max_continuations` ran out."""
        if behavior_correction and (mismatch := sampling.logprob_mismatch()):
            raise ValueError(f"behavior_correction needs untruncated sampling: {mismatch}")
        if not 0 <= routed_experts_from <= len(input_ids):
            raise ValueError(
                f"routed_experts_from {routed_experts_from} must be in [0, {len(input_ids)}]"
            )
        rid = rid or uuid.uuid4().hex
        prompt = list(input_ids)
        output_ids: list[int] = []
        logprobs: list[float] = []
        versions: list[str] = []
        routed: list[RoutedExperts] = []
        tops: list[TopLogProbs] = []
        attempts = continuations = 0
        while True:
            budget = sampling.max_new_tokens - len(output_ids)
            segment = sampling.model_copy(update={"max_new_tokens": budget})
            start = routed_experts_from + sum(part.positions for part in routed)
            fed = prompt + output_ids
            out, server, tries = await self._generate_segment(
                fed, segment, session_id, f"{rid}.{continuations}", start
            )
            attempts += tries
            output_ids += out.output_ids
            logprobs += out.output_logprobs
            versions += out.token_versions
            if out.top_logprobs_from:
                raise TopLogProbsUnavailable(
                    f"{server} sent no top-{self.config.top_logprobs} log-probs (null) for the "
                    f"first {out.top_logprobs_from} of {len(out.output_ids)} output tokens; the "
                    "top-K gate needs every token's: use learner.flash_reinforce.gate_kl "
                    "bernoulli with this server"
                )
            if out.top_logprobs is not None:
                tops.append(out.top_logprobs)
            if (layout := self.config.routed_experts) is not None:
                routed.append(self._segment_routing(out, layout, len(fed), start, server))
            finish = self._overall_finish(out.finish_reason, output_ids, sampling)
            if finish != "abort" or continuations == self.config.max_continuations:
                break
            continuations += 1
            self.metrics.continuations += 1
        return Rollout(
            rid=rid,
            prompt_ids=prompt,
            output_ids=output_ids,
            output_logprobs=logprobs,
            token_versions=versions,
            finish_reason=finish,
            routed_experts=RoutedExperts.concatenate(routed) if routed else None,
            server=server,
            attempts=attempts,
            continuations=continuations,
            top_logprobs=TopLogProbs.concatenate(tops) if tops else None,
        )

    @staticmethod
    def _overall_finish(
        finish: FinishReason, output_ids: list[int], sampling: SamplingParams
    ) -> FinishReason:
        """An aborted segment that already ends the rollout (stop token or full budget) is not
        continued."""
        if finish != "abort":
            return finish
        if output_ids and output_ids[-1] in sampling.stop_token_ids:
            return "stop"
        if len(output_ids) >= sampling.max_new_tokens:
            return "length"
        return "abort"

    def _segment_routing(
        self,
        out: GenerateOutput,
        layout: RoutedExpertsLayout,
        fed: int,
        start: int,
        server: str,
    ) -> RoutedExperts:
        """A segment's routed experts: positions [start, fed + output - 1), as SGLang returns
        them; none when the segment generated nothing (it may have fed nothing), and none at
        all from an abort in SGLang's waiting queue (module docstring)."""
        if out.routed_experts is None and not out.output_ids and out.finish_reason == "abort":
            empty = np.zeros((0, layout.num_layers, layout.top_k), dtype=np.int32)
            return RoutedExperts.compact(empty, layout.num_experts)
        if out.routed_experts is None:
            raise RoutedExpertsUnavailable(
                f"{server} sent no meta_info.routed_experts although asked: SGLang must run "
                "with --enable-return-routed-experts (and the model must be a MoE)"
            )
        rows = max(0, fed + len(out.output_ids) - 1 - start)
        if not out.output_ids and not out.routed_experts:
            rows = 0
        try:
            experts = decode_routed_experts(out.routed_experts, rows, layout)
        except MalformedResponse as error:
            self.metrics.failures[server] += 1
            raise error.from_server(server) from error
        return RoutedExperts.compact(experts, layout.num_experts)

    async def _generate_segment(
        self,
        prompt: list[int],
        sampling: SamplingParams,
        session_id: str | None,
        rid: str,
        routing_start: int,
    ) -> tuple[GenerateOutput, str, int]:
        """One segment on one server, retried on another server when the server fails or
        times out. Returns (output, server url, attempts)."""
        tried: set[str] = set()
        errors: list[str] = []
        failures = timeouts = attempt = 0
        while failures < self.config.max_attempts and timeouts < self.config.max_timeouts:
            server = self._pick(session_id, tried)
            if server is None:
                errors.append("no engine in the pool")
                break
            tried.add(server.url)
            attempt += 1
            if attempt > 1:
                self.metrics.retries += 1
            body = self._wire.generate_request(
                prompt,
                sampling,
                rid=f"{rid}.{attempt}",
                routed_experts_start_len=routing_start if self.config.routed_experts else None,
                top_logprobs_num=self.config.top_logprobs,
            )
            try:
                out = await self._post_generate(server, body)
            except _Timeout as exc:
                timeouts += 1
                errors.append(f"{server.url}: {exc}")
                continue
            except _Retryable as exc:
                server.down_until = time.monotonic() + self.config.server_cooldown_s
                server.failing += 1
                failures += 1
                errors.append(f"{server.url}: {exc}")
                continue
            server.failing = 0
            if len(out.output_ids) > sampling.max_new_tokens:
                self.metrics.failures[server.url] += 1
                raise MalformedResponse(
                    "output_ids",
                    f"{len(out.output_ids)} tokens for max_new_tokens={sampling.max_new_tokens}",
                    server.url,
                )
            if session_id is not None:
                self._sessions[session_id] = server.url
            return out, server.url, attempt
        raise ServersUnavailable(
            f"/generate failed {len(errors)} time(s) ({timeouts} timeout(s)): " + "; ".join(errors)
        )

    def _pick(self, session_id: str | None, tried: set[str]) -> _Server | None:
        """The session's server while it is up, else the up server with the fewest requests
        in flight or waiting for it for its limit, then the fewest sent (so sequential calls
        also alternate). Servers already tried for this segment come last, down ones by the end
        of their cooldown; servers out of the pool never (None when no server is in it)."""
        now = time.monotonic()
        pool = [server for server in self._servers.values() if server.in_pool]
        if not pool:
            return None
        sticky = self._servers.get(self._sessions.get(session_id, "")) if session_id else None
        if sticky in pool and sticky.url not in tried and sticky.down_until <= now:
            chosen = sticky
        else:
            fresh = [s for s in pool if s.url not in tried]
            chosen = min(
                fresh or pool,
                key=lambda s: (max(s.down_until - now, 0.0), s.queued / s.limit, s.sent),
            )
        chosen.sent += 1
        return chosen

    async def _post_generate(self, server: _Server, body: dict) -> GenerateOutput:
        await server.acquire()
        sent_at = time.monotonic()
        self.metrics.requests[server.url] += 1
        try:
            answer = await self._unless_taken_out(server, self._post_json(server.url, body))
            server.progress_at, server.timed_out_last = time.monotonic(), False
            server.served(self.config.max_in_flight)
            return self._wire.parse_generate(answer, self.config.top_logprobs)
        except MalformedResponse as exc:
            self.metrics.failures[server.url] += 1
            raise exc.from_server(server.url) from exc
        except _Timeout:
            self.metrics.failures[server.url] += 1
            self.metrics.timeouts[server.url] += 1
            server.timed_out_last = True
            server.slowed(sent_at)
            raise
        except (_Retryable, RequestRejected):
            self.metrics.failures[server.url] += 1
            raise
        finally:
            server.release()

    @staticmethod
    async def _unless_taken_out(server: _Server, post: Coroutine[Any, Any, object]) -> object:
        """The answer to `post`, or _Retryable as soon as the server leaves the pool (a hung
        server would otherwise hold the request until request_timeout_s)."""
        answer = asyncio.ensure_future(post)
        out = asyncio.ensure_future(server.out_event().wait())
        try:
            done, _ = await asyncio.wait({answer, out}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            out.cancel()
            if not answer.done():
                answer.cancel()
            elif not answer.cancelled():
                # Failed as this wait was cancelled (the run ending): read, so that its error
                # is not reported as never retrieved.
                answer.exception()
        if answer not in done:
            raise _Retryable(f"{server.url} was taken out of the pool")
        return answer.result()

    async def _post_json(self, url: str, body: dict) -> object:
        try:
            async with self._session().post(
                url + self._wire.generate_path, json=body, timeout=self._timeout
            ) as resp:
                raw = await resp.read()
        except aiohttp.ConnectionTimeoutError as exc:  # no connection: not a busy server
            raise _Retryable(f"{type(exc).__name__}: {exc}") from exc
        except TimeoutError as exc:
            raise _Timeout(
                f"{type(exc).__name__}: no answer within {self._timeout.total} s"
            ) from exc
        except aiohttp.ClientError as exc:
            raise _Retryable(f"{type(exc).__name__}: {exc}") from exc
        if resp.status >= 400:
            text = raw[:500].decode(errors="replace")
            if resp.status >= 500:
                raise _Retryable(f"HTTP {resp.status}: {text}")
            path = self._wire.generate_path
            raise RequestRejected(f"{url} rejected {path} with HTTP {resp.status}: {text}")
        try:
            return json.loads(raw)
        except ValueError as exc:  # not JSON, or not UTF-8
            raise MalformedResponse("response", f"not JSON ({exc})") from exc

    async def wait_healthy(self, deadline_s: float) -> None:
        """Poll GET /health on every server until all answer 200; TimeoutError naming the
        servers that did not, with their last error, once `deadline_s` seconds have passed."""
        deadline = time.monotonic() + deadline_s
        pending = {url: "not polled yet" for url in self._servers}
        while pending:
            results = await asyncio.gather(*(self._health(url, deadline) for url in pending))
            pending = {url: err for url, err in zip(pending, results, strict=True) if err}
            if not pending:
                return
            if time.monotonic() >= deadline:
                detail = "; ".join(f"{url}: {err}" for url, err in pending.items())
                raise TimeoutError(f"servers not healthy after {deadline_s} s: {detail}")
            await asyncio.sleep(min(0.2, max(deadline - time.monotonic(), 0.0)))

    async def _health(self, url: str, deadline: float) -> str | None:
        """None when `url` answers /health with 200, else what went wrong."""
        limit = max(min(self.config.connect_timeout_s, deadline - time.monotonic()), 0.05)
        try:
            async with self._session().get(
                url + HEALTH_PATH, timeout=aiohttp.ClientTimeout(total=limit)
            ) as resp:
                return None if resp.status == 200 else f"HTTP {resp.status}"
        except (aiohttp.ClientError, TimeoutError) as exc:
            return f"{type(exc).__name__}: {exc}"
