"""An SGLang-protocol HTTP server on the CPU, backed by transformers.

    python -m megatron_fr.engine.cpu_server --model-path HF_DIR --host 127.0.0.1 --port 30000

Speaks the subset of SGLang's HTTP API that RL training uses (field names as in SGLang's
io_struct): /health, /model_info, /generate (single and batched, input_ids or text),
/get_weight_version, /pause_generation, /continue_generation, /flush_cache, /abort_request,
/init_weights_update_group (backend "gloo"), /begin_weight_update and /end_weight_update
(the session SGLang requires around /update_weights_from_distributed),
/update_weights_from_distributed,
/update_weights_from_disk, /update_weight_version, /destroy_weights_update_group and
/get_weights_by_name. Requests are served concurrently (one thread each, interleaved token by
token); a model directory without tokenizer files serves input_ids requests.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from aiohttp import web

from megatron_fr.engine.cpu_engine import CpuEngine, Output, Sampling
from megatron_fr.engine.sglang_source import DistributedReceiver, SglangSourceMissing
from megatron_fr.utils.parent_watch import exit_when_parent_dies

log = logging.getLogger("megatron_fr.cpu_server")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class BadRequest(ValueError):
    """Answered with HTTP 400 and the message."""


def _field(body: dict, name: str, kind: type | tuple[type, ...], default: Any = ...) -> Any:
    if name not in body or body[name] is None:
        if default is ...:
            raise BadRequest(f"missing field {name!r}")
        return default
    value = body[name]
    if not isinstance(value, kind):
        raise BadRequest(f"field {name!r} must be {kind}, got {type(value).__name__}")
    return value


def _generate_response(output: Output, rid: str, tokenizer) -> dict:
    text = tokenizer.decode(output.output_ids) if tokenizer else ""
    return {
        "text": text,
        "output_ids": output.output_ids,
        "meta_info": {
            "id": rid,
            "finish_reason": output.finish_reason,
            "prompt_tokens": output.prompt_tokens,
            "completion_tokens": len(output.output_ids),
            "output_token_logprobs": [
                [logprob, token, None]
                for logprob, token in zip(output.logprobs, output.output_ids, strict=True)
            ],
            "weight_version": output.weight_version,
        },
    }


class CpuServer:
    """HTTP handlers around one CpuEngine; blocking work runs in a thread pool."""

    def __init__(self, engine: CpuEngine, max_concurrency: int = 32):
        self.engine = engine
        self.pool = ThreadPoolExecutor(max_workers=max_concurrency)
        # Weight updates get threads of their own: requests waiting out a pause hold every
        # generation thread, and the update that would end the pause must still run.
        self.control_pool = ThreadPoolExecutor(max_workers=4)
        self.receiver = DistributedReceiver()  # one process: TP rank 0 of a TP-1 server
        self.session_open = False  # SGLang's begin/end weight-update session

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    async def _control(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.control_pool, fn, *args)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=1024**3, middlewares=[_errors_as_json])
        get = {
            "/health": self.health,
            "/health_generate": self.health,
            "/model_info": self.model_info,
            "/get_weight_version": self.get_weight_version,
        }
        post = {
            "/generate": self.generate,
            "/pause_generation": self.pause_generation,
            "/continue_generation": self.continue_generation,
            "/flush_cache": self.flush_cache,
            "/abort_request": self.abort_request,
            "/init_weights_update_group": self.init_weights_update_group,
            "/begin_weight_update": self.begin_weight_update,
            "/end_weight_update": self.end_weight_update,
            "/update_weights_from_distributed": self.update_weights_from_distributed,
            "/update_weights_from_disk": self.update_weights_from_disk,
            "/update_weight_version": self.update_weight_version,
            "/destroy_weights_update_group": self.destroy_weights_update_group,
            "/get_weights_by_name": self.get_weights_by_name,
        }
        app.add_routes([web.get(path, handler) for path, handler in get.items()])
        app.add_routes([web.post(path, handler) for path, handler in post.items()])
        app.add_routes([web.get("/flush_cache", self.flush_cache)])  # SGLang takes both
        return app

    async def health(self, _request: web.Request) -> web.Response:
        return web.Response(text="")

    async def model_info(self, _request: web.Request) -> web.Response:
        return web.json_response(
            {
                "model_path": self.engine.model_path,
                "tokenizer_path": self.engine.model_path if self.engine.tokenizer else None,
                "is_generation": True,
                "weight_version": self.engine.weight_version,
            }
        )

    async def get_weight_version(self, _request: web.Request) -> web.Response:
        return web.json_response({"weight_version": self.engine.weight_version})

    async def generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        if body.get("return_routed_experts"):
            raise BadRequest("return_routed_experts is not supported by the CPU engine")
        prompts, batched = self._prompts(body)
        params = body.get("sampling_params") or {}
        params = params if isinstance(params, list) else [params] * len(prompts)
        rids = body.get("rid") or [uuid.uuid4().hex for _ in prompts]
        rids = rids if isinstance(rids, list) else [rids]
        if not len(params) == len(rids) == len(prompts):
            raise BadRequest("sampling_params and rid must match the number of prompts")
        try:
            samplings = [Sampling.from_json(p) for p in params]
        except (TypeError, ValueError) as error:
            raise BadRequest(str(error)) from error
        outputs = await asyncio.gather(
            *(
                self._run(self.engine.generate, *job)
                for job in zip(prompts, samplings, rids, strict=True)
            )
        )
        responses = [
            _generate_response(output, rid, self.engine.tokenizer)
            for output, rid in zip(outputs, rids, strict=True)
        ]
        return web.json_response(responses if batched else responses[0])

    def _prompts(self, body: dict) -> tuple[list[list[int]], bool]:
        if body.get("input_ids") is not None:
            ids = body["input_ids"]
            batched = bool(ids) and isinstance(ids[0], list)
            prompts = ids if batched else [ids]
            if not all(isinstance(t, int) for p in prompts for t in p):
                raise BadRequest("input_ids must be a list of token ids (or a list of lists)")
            return prompts, batched
        if body.get("text") is not None:
            if self.engine.tokenizer is None:
                raise BadRequest("this model directory has no tokenizer: send input_ids")
            texts = body["text"] if isinstance(body["text"], list) else [body["text"]]
            encoded = [self.engine.tokenizer.encode(text) for text in texts]
            return encoded, isinstance(body["text"], list)
        raise BadRequest("send input_ids or text")

    async def pause_generation(self, request: web.Request) -> web.Response:
        body = await _json_or_empty(request)
        self.engine.pause(_field(body, "mode", str, "abort"))
        return web.json_response({"success": True, "message": "paused"})

    async def continue_generation(self, _request: web.Request) -> web.Response:
        self.engine.resume()
        return web.json_response({"success": True, "message": "continued"})

    async def flush_cache(self, _request: web.Request) -> web.Response:
        # No prefix cache is kept across requests; SGLang refuses while requests are pending.
        if self.engine.active_requests:
            return web.Response(status=400, text="requests are pending; retry")
        return web.Response(text="Cache flushed.")

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await _json_or_empty(request)
        rid = _field(body, "rid", str, None)
        count = self.engine.abort(rid, abort_all=_field(body, "abort_all", bool, False))
        return web.json_response({"success": True, "aborted": count})

    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        """Join the learner's group with SGLang's own code (engine/sglang_source.py)."""
        body = await request.json()
        name = _field(body, "group_name", str, "weight_update_group")
        args = (
            _field(body, "master_address", str), _field(body, "master_port", int),
            _field(body, "rank_offset", int), _field(body, "world_size", int), name,
            _field(body, "backend", str, "gloo"),
        )  # fmt: skip
        try:
            rank = await self._control(self.receiver.join, *args)
        except SglangSourceMissing as error:
            message = f"the CPU engine joins weight groups with SGLang's code: {error}"
            raise BadRequest(message) from error
        return web.json_response({"success": True, "message": f"joined {name} as {rank}"})

    async def begin_weight_update(self, _request: web.Request) -> web.Response:
        if self.session_open:
            raise BadRequest("a weight-update session is already open; call end_weight_update")
        self.session_open = True
        return web.json_response({"success": True, "message": "Success"})

    async def end_weight_update(self, _request: web.Request) -> web.Response:
        if not self.session_open:
            raise BadRequest("no weight-update session is open; call begin_weight_update first")
        self.session_open = False
        return web.json_response({"success": True, "message": "Success"})

    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        body = await request.json()
        if not self.session_open:  # as SGLang 0.5.23 refuses it
            raise BadRequest(
                "update_weights_from_distributed must run between begin_weight_update() and "
                "end_weight_update()"
            )
        names, dtypes = _field(body, "names", list), _field(body, "dtypes", list)
        shapes = _field(body, "shapes", list)
        if not len(names) == len(dtypes) == len(shapes):
            raise BadRequest("names, dtypes and shapes must have the same length")
        unknown = sorted(set(dtypes) - DTYPES.keys())
        if unknown:
            raise BadRequest(f"unsupported dtypes {unknown}")
        group_name = _field(body, "group_name", str, "weight_update_group")
        if group_name not in self.receiver.groups:
            raise BadRequest(
                f"no weight update group {group_name!r}: call /init_weights_update_group"
            )
        load_format = _field(body, "load_format", str, None)

        def receive() -> int:  # as SGLang's WeightUpdater receives, then load
            tensors = self.receiver.receive(names, dtypes, shapes, group_name, load_format)
            return self.engine.load_named_tensors(tensors)

        count = await self._control(receive)
        self._maybe_set_version(body)
        return web.json_response({"success": True, "message": f"updated {count} tensors"})

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        body = await request.json()
        count = await self._control(self.engine.load_from_disk, _field(body, "model_path", str))
        self._maybe_set_version(body)
        return web.json_response(
            {"success": True, "message": f"loaded {count} tensors", "num_paused_requests": 0}
        )

    def _maybe_set_version(self, body: dict) -> None:
        version = body.get("weight_version")
        if version is not None:
            self.engine.weight_version = str(version)

    async def update_weight_version(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.engine.weight_version = str(_field(body, "new_version", (str, int)))
        if body.get("abort_all_requests"):
            self.engine.abort(abort_all=True)
        return web.json_response({"success": True, "message": self.engine.weight_version})

    async def destroy_weights_update_group(self, request: web.Request) -> web.Response:
        body = await request.json()
        name = _field(body, "group_name", str, "weight_update_group")
        if not await self._control(self.receiver.destroy, name):
            raise BadRequest(f"no weight update group {name!r} to destroy")
        return web.json_response({"success": True, "message": "destroyed"})

    async def get_weights_by_name(self, request: web.Request) -> web.Response:
        body = await request.json()
        try:
            tensor = self.engine.read_named_tensor(_field(body, "name", str))
        except KeyError as error:
            raise BadRequest(str(error.args[0])) from error
        values = tensor.float().flatten()[: _field(body, "truncate_size", int, 100)]
        return web.json_response(values.tolist())


async def _json_or_empty(request: web.Request) -> dict:
    return await request.json() if request.can_read_body else {}


@web.middleware
async def _errors_as_json(request: web.Request, handler):
    """Bad input -> 400 with SGLang's {"error": {"message": ...}} body; the server lives on."""
    try:
        return await handler(request)
    except (BadRequest, ValueError, KeyError) as error:
        return web.json_response({"error": {"message": str(error)}}, status=400)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", required=True, help="HF model directory")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--max-concurrency", type=int, default=32)
    parser.add_argument(
        "--parent-pid",
        type=int,
        default=None,
        help="exit when this process is gone (the launcher runs the engine in its own session, "
        "so a killed trainer would otherwise leave it behind)",
    )
    args = parser.parse_args(argv)
    if args.parent_pid:
        exit_when_parent_dies(args.parent_pid)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    engine = CpuEngine(args.model_path, dtype=DTYPES[args.dtype])
    log.info("serving %s on http://%s:%d", args.model_path, args.host, args.port)
    web.run_app(
        CpuServer(engine, args.max_concurrency).app(),
        host=args.host,
        port=args.port,
        print=None,
        access_log=None,
    )


if __name__ == "__main__":
    main()
