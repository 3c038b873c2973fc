"""An SGLang-protocol HTTP server on the CPU, backed by transformers.

    python -m megatron_fr.engine.cpu.server --model-path HF_DIR --host 127.0.0.1 --port 30000

Speaks the subset of SGLang's HTTP API that RL training uses (field names as in SGLang's
io_struct), and no route SGLang lacks (tests/unit/test_engine_contract.py): /health,
/model_info (the served weight_version among SGLang's fields), /server_info (SGLang's fields
for a one-process server, and "engine": "megatron-fr-cpu": engine/server_info.py),
/generate (single and batched, input_ids or text), /pause_generation, /continue_generation,
/flush_cache, /abort_request, /init_weights_update_group (backend "gloo"),
/begin_weight_update and /end_weight_update (the session SGLang requires around
/update_weights_from_distributed), /update_weights_from_distributed,
/update_weights_from_disk, /update_weight_version, /destroy_weights_update_group and
/get_weights_by_name. Requests are served concurrently (one thread each, interleaved token by
token); a model directory without tokenizer files serves input_ids requests.

A /generate response carries SGLang's per-token version spans, meta_info.weight_versions =
[{"version", "start", "end"}, ...] over the output tokens, and meta_info.weight_version = the
last span's version (srt/utils/weight_versions.py). Hostile or broken clients cannot wedge it:
bodies are bounded in size, arrival time and depth before they are parsed (cpu_requests: 413,
408, 400), a /generate in prompts, tokens and characters before any tokenising, and in the
log-probs its answer may carry (--max-request-logprobs) (cpu_wire, 400 naming the field or
the flag), a weight-group join in time (--weight-group-timeout-s, on a thread of its own), a
disk load to regular files; a client that disconnects ends its generation (every prompt of
it: those not started never start), and an answer is encoded on a worker thread, entry by
entry, so /health answers meanwhile.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, TypeVar

import torch
from aiohttp import web

from megatron_fr.engine.cpu.engine import CpuEngine, Output
from megatron_fr.engine.cpu.requests import (
    DISCONNECT_POLL_S,
    READ_TIMEOUT_S,
    ClientGone,
    errors_as_json,
    json_object,
    unless_disconnected,
)
from megatron_fr.engine.cpu.wire import (
    DTYPES,
    BadRequest,
    GenerateJob,
    PromptLimits,
    answer_json,
    bool_flags,
    bucket_metadata,
    check_session_selector,
    field,
    generate_response,
    join_args,
    parse_generate,
    sglang_base_request,
    version_field,
)
from megatron_fr.engine.server_info import CPU_ENGINE, ENGINE_FIELD, INSTANCE_FIELD
from megatron_fr.engine.sglang.source import DistributedReceiver, JoinArgs, SglangSourceMissing
from megatron_fr.utils.cpu_kernels import pin_cpu_kernels
from megatron_fr.utils.parent_watch import exit_when_parent_dies

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger("megatron_fr.cpu_server")
T = TypeVar("T")

DEFAULT_MAX_REQUEST_MIB = 16
"""Largest request body accepted (a 131 072-token prompt of six-digit token ids is 0.92 MiB of
JSON)."""
DEFAULT_MAX_BATCH_PROMPTS = 1024
"""Prompts one /generate may carry (the rollout client sends one)."""
DEFAULT_READ_TIMEOUT_S = 60.0
"""How long a request's headers and body may take to arrive."""
DEFAULT_MAX_REQUEST_LOGPROBS = 2**21
"""Log-probs one /generate's answer may carry (its prompts' most output tokens x (1 +
top_logprobs_num)); a request past it is refused at admission (HTTP 400 naming the flag).
2 Mi is a single prompt of 32k tokens with top-63 log-probs, or 2048 tokens x 1024 prompts
without: an answer of about 70 MB of JSON, built in 1 to 2.5 s on a worker thread (2 cores)."""
DEFAULT_JOIN_TIMEOUT_S = 60.0
"""How long joining a weight-update group may wait for its master (and its other ranks), and
each of the group's broadcasts: half the learner's own deadline for the join (weights.timeout_s,
120 s), so an engine whose master never answers says so before the learner gives up."""
DISK_LOAD_FORMATS = (None, "auto", "safetensors")
AUTO_DECOMPRESS = False
"""aiohttp's server option: off, so bodies are read as sent and inflated off the event loop,
within the body limit (cpu_requests.inflate)."""


class CpuServer:
    """HTTP handlers around one CpuEngine; blocking work runs in a thread pool.

    What it uses of the engine (a stand-in must offer the same): model_path, tokenizer,
    dtype, context_length, return_routed_experts, weight_version, active_requests,
    running_requests,
    generate(input_ids, sampling, rid, routed_experts_start=None, top_logprobs=0) -> Output,
    abort(rid, abort_all) (also on client disconnect), pause(mode), resume(), and
    weights (cpu_weights.ServedWeights) for the weight-update endpoints."""

    def __init__(
        self,
        engine: CpuEngine,
        max_concurrency: int = 32,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_MIB * 2**20,
        max_batch_prompts: int = DEFAULT_MAX_BATCH_PROMPTS,
        read_timeout_s: float = DEFAULT_READ_TIMEOUT_S,
        join_timeout_s: float = DEFAULT_JOIN_TIMEOUT_S,
        max_request_logprobs: int = DEFAULT_MAX_REQUEST_LOGPROBS,
    ):
        self.engine = engine
        self.max_concurrency = max_concurrency
        self.max_request_bytes = max_request_bytes
        self.read_timeout_s, self.join_timeout_s = read_timeout_s, join_timeout_s
        self.limits = PromptLimits.of(
            engine.tokenizer, engine.context_length, max_batch_prompts, max_request_logprobs
        )
        self.pool = ThreadPoolExecutor(max_workers=max_concurrency)
        # Weight updates get threads of their own: requests waiting out a pause hold every
        # generation thread, and the update that would end the pause must still run. Group
        # joins get a thread each (DistributedReceiver.start_join), answered 400 after
        # join_timeout_s: a master that never answers holds neither.
        self.control_pool = ThreadPoolExecutor(max_workers=4)
        self.receiver = DistributedReceiver()  # one process: TP rank 0 of a TP-1 server
        self._stopping: set[asyncio.Task] = set()
        """Aborts of the prompts of requests whose clients left, repeated until they end."""
        self.instance = uuid.uuid4().hex  # /server_info: one process under two URLs is one

    async def _run(self, fn: Callable[..., T], *args: object) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    async def _control(self, fn: Callable[..., T], *args: object) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.control_pool, fn, *args)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.max_request_bytes, middlewares=[errors_as_json])
        app[READ_TIMEOUT_S] = self.read_timeout_s
        get = {
            "/health": self.health,
            "/health_generate": self.health,
            "/model_info": self.model_info,
            "/server_info": self.server_info,
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

    async def server_info(self, _request: web.Request) -> web.Response:
        """SGLang's /server_info fields (ServerArgs names) for this one-process server, so the
        one reader (engine/server_info.py) sizes and checks it as it does SGLang."""
        engine = self.engine
        return web.json_response(
            {
                "model_path": engine.model_path,
                "skip_tokenizer_init": engine.tokenizer is None,
                "dtype": str(engine.dtype).removeprefix("torch."),
                "context_length": engine.context_length,
                "max_running_requests": self.max_concurrency,
                "tp_size": 1,
                "pp_size": 1,
                "dp_size": 1,
                "attn_dp_size": 1,
                "ep_size": 1,
                "nnodes": 1,
                "enable_dp_attention": False,
                "enable_return_routed_experts": engine.return_routed_experts,
                ENGINE_FIELD: CPU_ENGINE,
                INSTANCE_FIELD: self.instance,
            }
        )

    # --- generation ---------------------------------------------------------------------

    async def generate(self, request: web.Request) -> web.Response:
        body = await json_object(request)
        gone = threading.Event()
        jobs, batched, work = await asyncio.to_thread(self._admit, body, gone)
        try:
            waiting = asyncio.gather(*map(asyncio.wrap_future, work))
            outputs = await unless_disconnected(request, waiting)
        except BaseException as error:
            # A client gone, a cancelled handler or a refused prompt of a batch: nothing more
            # of this request is worth computing.
            gone.set()
            for job, future in zip(jobs, work, strict=True):
                if not future.cancel() and not future.done():  # started: ended at a step
                    self._stop(job.rid, future)
            if isinstance(error, ClientGone):
                return web.Response(status=499, text="client disconnected")
            raise
        tokenizer = self.engine.tokenizer
        answer = await asyncio.to_thread(_answer, outputs, jobs, batched, tokenizer)
        return web.Response(body=answer, content_type="application/json")

    def _admit(
        self, body: dict, gone: threading.Event
    ) -> tuple[list[GenerateJob], bool, list[Future]]:
        """The jobs of a /generate body (refused past the server's limits), each submitted to
        the generation threads: off the event loop, where starting the pool's threads would
        hold /health (a thread's start waits for it to run)."""
        jobs, batched = parse_generate(body, self.limits)
        return jobs, batched, [self.pool.submit(self._generate_one, job, gone) for job in jobs]

    def _stop(self, rid: str, work: Future) -> None:
        """Abort `rid` until its generation has ended: a prompt that was past its check of
        `gone` but not yet running in the engine misses the first abort, not the next."""

        async def abort_until_done() -> None:
            while not work.done():
                self.engine.abort(rid)
                await asyncio.sleep(DISCONNECT_POLL_S)

        task = asyncio.ensure_future(abort_until_done())
        self._stopping.add(task)
        task.add_done_callback(self._stopping.discard)

    def _generate_one(self, job: GenerateJob, gone: threading.Event) -> Output:
        prompt = job.prompt
        if isinstance(prompt, str):
            if self.engine.tokenizer is None:
                raise BadRequest("this model directory has no tokenizer: send input_ids")
            prompt = self.engine.tokenizer.encode(prompt)
        if gone.is_set():  # the client left while this prompt waited for a thread
            raise ClientGone()
        return self.engine.generate(
            prompt,
            job.sampling,
            job.rid,
            routed_experts_start=job.routed_experts_start,
            top_logprobs=job.top_logprobs_num,
        )

    # --- control ------------------------------------------------------------------------

    async def pause_generation(self, request: web.Request) -> web.Response:
        body = await json_object(request, empty_ok=True)
        sglang_base_request(body)  # other names: ignored, as SGLang ignores them
        self.engine.pause(field(body, "mode", str, "abort"))
        return web.json_response({"success": True, "message": "paused"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        body = await json_object(request, empty_ok=True)
        sglang_base_request(body)
        field(body, "torch_empty_cache", bool, True)  # no CUDA cache to empty
        self.engine.resume()
        return web.json_response({"success": True, "message": "continued"})

    async def flush_cache(self, _request: web.Request) -> web.Response:
        # No prefix cache is kept across requests; SGLang refuses while requests are pending.
        if self.engine.running_requests:
            return web.Response(status=400, text="requests are pending; retry")
        return web.Response(text="Cache flushed.")

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await json_object(request, empty_ok=True)
        rid = field(body, "rid", str, None)
        count = self.engine.abort(rid, abort_all=field(body, "abort_all", bool, False))
        return web.json_response({"success": True, "aborted": count})

    # --- weights ------------------------------------------------------------------------

    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        """Join the learner's group with SGLang's own code (engine/sglang/source.py)."""
        body = await json_object(request)
        args: JoinArgs = join_args(body)
        name = args[4]
        joined = self.receiver.start_join(args, timeout_s=self.join_timeout_s)
        try:
            rank = await asyncio.wait_for(asyncio.wrap_future(joined), self.join_timeout_s)
        except SglangSourceMissing as error:
            message = f"the CPU engine joins weight groups with SGLang's code: {error}"
            raise BadRequest(message) from error
        except TimeoutError as error:  # the master (or a rank) never answered
            raise BadRequest(
                f"joining {name} with master {args[0]}:{args[1]}: no answer within "
                f"{self.join_timeout_s:g} s (--weight-group-timeout-s)"
            ) from error
        except RuntimeError as error:  # torch's store and group errors
            raise BadRequest(
                f"joining {name} with master {args[0]}:{args[1]} failed within "
                f"{self.join_timeout_s:g} s (--weight-group-timeout-s): {error}"
            ) from error
        return web.json_response({"success": True, "message": f"joined {name} as {rank}"})

    async def begin_weight_update(self, request: web.Request) -> web.Response:
        check_session_selector(await json_object(request, empty_ok=True))
        self.engine.weights.begin_update()
        return web.json_response({"success": True, "message": "Success"})

    async def end_weight_update(self, request: web.Request) -> web.Response:
        check_session_selector(await json_object(request, empty_ok=True))
        count = await self._control(self.engine.weights.end_update)
        return web.json_response({"success": True, "message": f"applied {count} tensors"})

    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        try:  # a bucket refused for any reason makes the session's end discard all of it
            body = await json_object(request)
            if not self.engine.weights.session_open:  # checked first, as SGLang 0.5.23 does
                raise BadRequest(
                    "update_weights_from_distributed must run between begin_weight_update() "
                    "and end_weight_update()"
                )
            names, dtypes, shapes = bucket_metadata(body)
            group_name = field(body, "group_name", str, "weight_update_group")
            if group_name not in self.receiver.groups:
                raise BadRequest(
                    f"no weight update group {group_name!r}: call /init_weights_update_group"
                )
            version = version_field(body, "weight_version", None)
            bool_flags(body, "flush_cache", "abort_all_requests")
            load_format = field(body, "load_format", str, None)
            if load_format not in (None, "flattened_bucket"):
                raise BadRequest("load_format must be null (tensor by tensor) or flattened_bucket")
            self.engine.weights.check_update(list(zip(names, shapes, strict=True)))
        except ValueError as error:
            self.engine.weights.fail_update(str(error))
            raise
        if body.get("abort_all_requests"):
            self.engine.abort(abort_all=True)

        def receive() -> int:  # as SGLang's WeightUpdater receives, then staged
            try:
                tensors = self.receiver.receive(names, dtypes, shapes, group_name, load_format)
                return self.engine.weights.stage(tensors, version)
            except Exception as error:
                self.engine.weights.fail_update(f"receiving the bucket failed: {error}")
                raise

        count = await self._control(receive)
        return web.json_response({"success": True, "message": f"received {count} tensors"})

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        body = await json_object(request)
        path = field(body, "model_path", str)
        version = version_field(body, "weight_version", None)
        bool_flags(body, "flush_cache", "abort_all_requests")
        if body.get("load_format") not in DISK_LOAD_FORMATS:
            raise BadRequest(f"load_format must be one of {DISK_LOAD_FORMATS}")
        if body.get("abort_all_requests"):
            self.engine.abort(abort_all=True)
        count = await self._control(self.engine.weights.load_from_disk, path, version)
        return web.json_response(
            {"success": True, "message": f"loaded {count} tensors", "num_paused_requests": 0}
        )

    async def update_weight_version(self, request: web.Request) -> web.Response:
        body = await json_object(request)
        version = version_field(body, "new_version")
        if field(body, "abort_all_requests", bool, True):  # SGLang's default, before relabeling
            self.engine.abort(abort_all=True)
        await self._control(self.engine.weights.set_version, version)
        return web.json_response({"success": True, "message": version})

    async def destroy_weights_update_group(self, request: web.Request) -> web.Response:
        body = await json_object(request)
        name = field(body, "group_name", str, "weight_update_group")
        if not await self._control(self.receiver.destroy, name):
            raise BadRequest(f"no weight update group {name!r} to destroy")
        return web.json_response({"success": True, "message": "destroyed"})

    async def get_weights_by_name(self, request: web.Request) -> web.Response:
        body = await json_object(request)
        name = field(body, "name", str)
        size = field(body, "truncate_size", int, 100)
        if size < 0:
            raise BadRequest(f"truncate_size must be >= 0, got {size}")
        tensor = await self._control(self.engine.weights.read, name)
        return web.json_response(tensor.float().flatten()[:size].tolist())


def _answer(
    outputs: list[Output],
    jobs: list[GenerateJob],
    batched: bool,
    tokenizer: PreTrainedTokenizerBase | None,
) -> bytes:
    """The JSON of a /generate answer (built on a worker thread: cpu_wire.answer_json)."""
    responses = [
        generate_response(output, job.rid, tokenizer, as_json=True)
        for output, job in zip(outputs, jobs, strict=True)
    ]
    return answer_json(responses if batched else responses[0])


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--model-path", required=True, help="HF model directory")
    add("--host", default="127.0.0.1")
    add("--port", type=int, default=30000)
    add("--dtype", choices=sorted(DTYPES), default="float32")
    add("--threads", type=int, default=None, help="torch intra-op threads")
    add("--max-concurrency", type=int, default=32)
    add(
        "--context-length",
        type=int,
        default=None,
        help="longest prompt + max_new_tokens accepted (as SGLang's flag; default: the "
        "config's max_position_embeddings)",
    )
    add(
        "--enable-return-routed-experts",
        action="store_true",
        help="as SGLang's flag: requests may ask for their routed experts (MoE routing replay)",
    )
    add(
        "--max-request-mib",
        type=float,
        default=DEFAULT_MAX_REQUEST_MIB,
        help="largest request body accepted; larger ones get HTTP 413, before being read",
    )
    add(
        "--max-batch-prompts",
        type=int,
        default=DEFAULT_MAX_BATCH_PROMPTS,
        help="prompts one /generate may carry",
    )
    add(
        "--max-request-logprobs",
        type=int,
        default=DEFAULT_MAX_REQUEST_LOGPROBS,
        help="log-probs one /generate's answer may carry: its prompts' most output tokens x "
        "(1 + top_logprobs_num), summed; a request past it gets HTTP 400 at admission",
    )
    add(
        "--read-timeout-s",
        type=float,
        default=DEFAULT_READ_TIMEOUT_S,
        help="a request whose body has not arrived by then gets HTTP 408 (one stalled in its "
        "headers is closed)",
    )
    add(
        "--weight-group-timeout-s",
        type=float,
        default=DEFAULT_JOIN_TIMEOUT_S,
        help="how long /init_weights_update_group waits for the group's master and ranks "
        "(and each broadcast of the group); past it the join is answered HTTP 400",
    )
    add(
        "--parent-pid",
        type=int,
        default=None,
        help="exit when this process is gone (the launcher runs the engine in its own "
        "session, so a killed trainer would otherwise leave it behind)",
    )
    return parser


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    pin_cpu_kernels()  # an entry point that computes (a no-op when its starter pinned them)
    if args.parent_pid:
        exit_when_parent_dies(args.parent_pid)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    engine = CpuEngine(
        args.model_path,
        DTYPES[args.dtype],
        args.context_length,
        return_routed_experts=args.enable_return_routed_experts,
    )
    log.info(
        "serving %s on http://%s:%d (context length %d)",
        args.model_path,
        args.host,
        args.port,
        engine.context_length,
    )
    server = CpuServer(
        engine,
        args.max_concurrency,
        int(args.max_request_mib * 2**20),
        args.max_batch_prompts,
        args.read_timeout_s,
        args.weight_group_timeout_s,
        args.max_request_logprobs,
    )
    web.run_app(
        server.app(),
        host=args.host,
        port=args.port,
        print=None,
        access_log=None,
        keepalive_timeout=args.read_timeout_s,
        auto_decompress=AUTO_DECOMPRESS,
    )


if __name__ == "__main__":
    main()
