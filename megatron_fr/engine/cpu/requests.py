"""The CPU engine's request bodies, read within bounds, and its answers to bad requests.

One request must neither cost the server more than it can afford nor stop it answering
/health, so a body is refused before it is read or parsed when it cannot be served:

    Content-Length over the limit          413 before a byte of the body is read
    a body that stops arriving             408 after the read timeout (a connection that
                                           stalls in its headers is closed after the same
                                           time: cpu_server gives it as the keep-alive timeout)
    gzip / deflate inflating past the      413 once the limit is passed, inflated a chunk at
      limit (a deflate bomb)                   a time on a worker thread
    another Content-Encoding               415
    not JSON, not a JSON object            400
    nested deeper than MAX_JSON_DEPTH      400 (Python's parser would raise RecursionError)
    what SGLang's parser (orjson) refuses  400 naming the field: a UTF-8 byte order mark, a
      and Python's takes                       body not in UTF-8, NaN, Infinity, a number past
                                               a double, a lone surrogate (parse_json)

The server reads bodies as they were sent (cpu_server: AUTO_DECOMPRESS turns aiohttp's own
inflating off, which runs on the event loop: a 260 KiB body inflating to 256 MiB held /health
there for seconds), and a compressed body is inflated here.

Bodies over PARSE_IN_THREAD_BYTES are parsed on a worker thread, so the event loop keeps
answering other requests meanwhile. A /generate whose client disconnects stops waiting at once
(unless_disconnected), so its generation can be ended. Every refusal is SGLang's error body
({"error": {"message": ...}}) with the reason; bad input never gets a 500.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import zlib
from typing import Any, TypeVar

from aiohttp import web
from aiohttp.typedefs import Handler

from megatron_fr.engine.cpu.weights import WeightsFault
from megatron_fr.engine.cpu.wire import BadRequest

log = logging.getLogger("megatron_fr.cpu_server")
T = TypeVar("T")

READ_TIMEOUT_S = web.AppKey("read_timeout_s", float)
"""How long a request body may take to arrive (the app's setting)."""
MAX_JSON_DEPTH = 32
"""Nesting a body may have; SGLang's request bodies need 4."""
PARSE_IN_THREAD_BYTES = 64 * 2**10
"""Bodies larger than this are parsed off the event loop."""
UTF8_BOM = b"\xef\xbb\xbf"
FINITE_INT_CHARS = 309
"""A JSON integer shorter than this is a finite double (the largest, 1.8e308, has 309
digits)."""
LONE_SURROGATE = re.compile(rb"\\[uU][dD][89a-fA-F]")
"""A \\ud800-\\udfff escape: only a body holding one has its strings checked for a lone
surrogate."""
INFLATE_CHUNK_BYTES = 2**20
"""A compressed body is inflated this much at a time, so its size is checked as it grows."""
INFLATED_ENCODINGS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": 0}
"""Content-Encodings a body may have, with zlib's window bits (deflate: zlib-wrapped or raw,
as clients send either)."""
DISCONNECT_POLL_S = 0.1
"""How often a waiting /generate checks whether its client is still connected."""


class ClientGone(Exception):
    """The HTTP client of a /generate disconnected before its answer."""


async def json_object(request: web.Request, empty_ok: bool = False) -> dict:
    """The request body as a JSON object (module docstring for the refusals); {} for an empty
    body where the endpoint has only optional fields."""
    limit, size = request.client_max_size, request.content_length
    if size is not None and size > limit:
        raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=size)
    timeout = request.app[READ_TIMEOUT_S]
    try:
        raw = await asyncio.wait_for(request.read(), timeout)
    except TimeoutError:
        raise web.HTTPRequestTimeout(
            text=f"the request body did not arrive within {timeout:g} s"
        ) from None
    encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
    if encoding != "identity":
        raw = await asyncio.to_thread(inflate, raw, encoding, limit)
    if not raw.strip() and empty_ok:
        return {}
    if len(raw) > PARSE_IN_THREAD_BYTES:
        body = await asyncio.to_thread(parse_json, raw)
    else:
        body = parse_json(raw)
    if not isinstance(body, dict):
        raise BadRequest(f"the body must be a JSON object, got {type(body).__name__}")
    return body


def inflate(raw: bytes, encoding: str, limit: int) -> bytes:
    """A gzip or deflate body inflated, INFLATE_CHUNK_BYTES at a time: 413 as soon as it
    passes `limit` bytes, 415 for another encoding, 400 for a stream that is broken."""
    if encoding not in INFLATED_ENCODINGS:
        raise web.HTTPUnsupportedMediaType(
            text=f"Content-Encoding {encoding[:40]!r}: send identity, gzip or deflate"
        )
    wbits = INFLATED_ENCODINGS[encoding]
    if wbits == 0:  # deflate: a zlib header (RFC 1950) or a bare stream
        wbits = zlib.MAX_WBITS if raw[:1] and raw[0] & 0x0F == 8 else -zlib.MAX_WBITS
    inflater, inflated, pending = zlib.decompressobj(wbits), bytearray(), raw
    try:
        while pending and not inflater.eof:
            inflated += inflater.decompress(pending, INFLATE_CHUNK_BYTES)
            if len(inflated) > limit:
                raise web.HTTPRequestEntityTooLarge(
                    max_size=limit,
                    actual_size=len(inflated),
                    text=f"the {encoding} body inflates past {limit} bytes",
                )
            pending = inflater.unconsumed_tail
    except zlib.error as error:
        raise BadRequest(f"the {encoding} body is not a valid stream: {error}") from None
    if not inflater.eof:
        raise BadRequest(f"the {encoding} body is cut short")
    return bytes(inflated)


def parse_json(raw: bytes) -> object:
    """JSON text read as SGLang's server reads it (orjson: srt/entrypoints/http_server.py,
    ORJSONRequest), at most MAX_JSON_DEPTH deep; BadRequest naming the fault otherwise.

    What Python's parser would take and SGLang's refuses is refused here too: a UTF-8 byte
    order mark, a body in another encoding (UTF-16, UTF-32), NaN and Infinity, a number that
    is not finite as a double (1e400, an integer of 310 digits), a lone surrogate escape.
    What SGLang takes is taken: -0 (the integer 0), -0.0, a number of any number of digits
    that rounds to a finite double."""
    if raw.startswith(UTF8_BOM):
        raise BadRequest("the body starts with a UTF-8 byte order mark, which JSON text must not")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise BadRequest(f"the body is not JSON: it is not UTF-8 ({error})") from None
    try:
        value = json.loads(text, parse_int=_json_int)
    except RecursionError:
        raise BadRequest(f"the body is nested deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as error:  # not JSON
        raise BadRequest(f"the body is not JSON: {error}") from error
    _check_tree(value, surrogates=LONE_SURROGATE.search(raw) is not None)
    return value


def _json_int(text: str) -> int | float:
    """A JSON integer; one past any finite double is read as the double it rounds to (an
    infinity, as SGLang's parser reads it), so that it is refused by name like 1e400 (and
    Python's int() would refuse one of over 4300 digits with a message naming no field)."""
    if len(text) < FINITE_INT_CHARS or math.isfinite(float(text)):
        return int(text)
    return float(text)


def _check_tree(value: object, surrogates: bool) -> None:
    """Refuse nesting past MAX_JSON_DEPTH and, naming its path, any number that is not
    finite as a double (and, with `surrogates`, any string holding a lone surrogate)."""
    if not isinstance(value, dict | list):
        return  # no JSON object: json_object refuses it
    stack: list[tuple[dict | list, int, str]] = [(value, 1, "")]
    while stack:
        item, depth, path = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise BadRequest(f"the body is nested deeper than {MAX_JSON_DEPTH} levels")
        pairs = item.items() if isinstance(item, dict) else enumerate(item)
        odd = [
            (key, child)
            for key, child in pairs
            if isinstance(child, dict | list | float)
            or (surrogates and isinstance(child, str))
            or (surrogates and isinstance(key, str))
        ]
        for key, child in odd:
            where = f"{path}.{key}" if isinstance(key, str) else f"{path}[{key}]"
            where = where.removeprefix(".")
            if isinstance(child, dict | list):
                stack.append((child, depth + 1, where))
            else:
                _check_leaf(child, where, surrogates)
            if surrogates and isinstance(key, str):
                _check_leaf(key, f"the name of {where}", surrogates)


def _check_leaf(value: object, where: str, surrogates: bool) -> None:
    where = where.encode("utf-8", "backslashreplace").decode("utf-8")  # a name may hold one
    if isinstance(value, float) and not math.isfinite(value):
        raise BadRequest(
            f"field {where!r} must be finite, got {value} (JSON has no NaN or Infinity, and "
            "a number past 1.8e308 overflows a double)"
        )
    if surrogates and isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise BadRequest(
                f"{where:.120} holds a lone surrogate (an unpaired \\ud800-\\udfff escape), "
                "which is not text"
            ) from None


def error_response(status: int, message: str) -> web.Response:
    """SGLang's error body: {"error": {"message": ...}}."""
    return web.json_response({"error": {"message": message}}, status=status)


@web.middleware
async def errors_as_json(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Bad input -> 400 naming the field, a body over the limit -> 413, one too slow -> 408,
    an unknown path -> 404, half-loaded weights -> 503; always a JSON reason, and the server
    lives on."""
    try:
        return await handler(request)
    except web.HTTPException as error:
        if error.status < 400:
            raise
        message = error.text or ""
        if message in ("", f"{error.status}: {error.reason}"):  # aiohttp's bare default
            message = f"{error.reason}: {request.method} {request.path}"
        return error_response(error.status, message)
    except KeyError as error:  # a tensor name the model does not have
        return error_response(400, str(error.args[0]) if error.args else "unknown key")
    except ValueError as error:  # BadRequest, RequestError, malformed JSON, ...
        return error_response(400, str(error))
    except WeightsFault as error:
        return error_response(503, str(error))
    except Exception as error:
        log.exception("%s %s failed", request.method, request.path)
        return error_response(500, f"internal error: {type(error).__name__}: {error}")


async def unless_disconnected(request: web.Request, work: asyncio.Future[T]) -> T:
    """The result of `work`, or ClientGone as soon as the client has disconnected (aiohttp
    cancels the handler on disconnect only when the runner is built with handler_cancellation;
    polling the transport works either way)."""

    async def disconnected() -> None:
        while request.transport is not None and not request.transport.is_closing():
            await asyncio.sleep(DISCONNECT_POLL_S)

    watcher = asyncio.ensure_future(disconnected())
    racing: set[asyncio.Future[Any]] = {work, watcher}
    try:
        done, _ = await asyncio.wait(racing, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if work not in done:
        work.cancel()
        work.add_done_callback(lambda future: future.cancelled() or future.exception())
        raise ClientGone()
    return work.result()
