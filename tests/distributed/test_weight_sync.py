"""Weight sync: resharding from any layout equals the converter's HF output bitwise, sent
overlapped or one bucket after the other alike; a send that fails mid-stream makes every rank
raise together and leaves the ranks in step; and the weights a learner broadcasts over gloo
are the weights the CPU engine then samples with."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from stub_server import StubServer
from tiny_qwen import saved_tensors, tiny_checkpoint, to_megatron_on_rank

from megatron_fr.config import ParallelConfig
from megatron_fr.engine.sglang import protocol
from megatron_fr.parallel.spawn import run_on_ranks
from megatron_fr.utils.net import free_port

RESHARD_LAYOUTS = {
    "qwen3_moe": [
        dict(tensor=2, expert=2, sequence_parallel=True),  # experts over ETP2 x EP2
        # as the flagship's recipe: ETP1; the second data-parallel replica takes no part
        dict(tensor=2, expert=2, expert_tensor=1, sequence_parallel=True),
        dict(pipeline=2),
        dict(pipeline=2, expert=2),
    ],
    "qwen2": [dict(pipeline=2, tensor=2)],  # tied embeddings: only the first stage sends them
}
BUCKET_BYTES = 20_000
SENT_BEFORE_FAILING = 2


def load_learner(megatron_dir: str, config: dict, parallel: ParallelConfig):
    from megatron_fr.convert.checkpoint import load_megatron_checkpoint
    from megatron_fr.models.gpt import build_gpt_model
    from megatron_fr.models.hf_config import load_hf_config
    from megatron_fr.parallel import state

    state.initialize(parallel, seed=0)
    spec = load_hf_config(config)
    model = build_gpt_model(spec, parallel, params_dtype=torch.float32, initialize=False)
    load_megatron_checkpoint(model, megatron_dir)
    return spec, model.eval()


def recording_transport(fail_at: int | None = None):
    """A transport that keeps copies of what it is sent (a bucket may hold views of the
    parameters); with fail_at, the send of that bucket raises while the next is built."""
    from megatron_fr.weights.transports import Engine, WeightTransport

    class Recording(WeightTransport):
        def __init__(self):
            super().__init__([Engine("http://unused", 1, "cpu")], timeout_s=60)
            self.buckets, self.attempts = [], 0

        def send(self, bucket):
            self.attempts += 1
            if self.attempts == fail_at:
                time.sleep(0.2)  # still in flight while the next bucket is being built
                raise RuntimeError(f"injected: bucket {fail_at} lost")
            self.buckets.append([(name, tensor.clone()) for name, tensor in bucket])

    return Recording()


def sync_with(model, spec, url: str, overlap: bool, transport) -> tuple:
    """One WeightSync.sync through `transport`: (error message or None, sent buckets)."""
    from megatron_fr.config import WeightSyncConfig
    from megatron_fr.weights.sync import WeightSync, WeightSyncError
    from megatron_fr.weights.transports import Engine

    config = WeightSyncConfig(overlap=overlap, flush_cache=False, timeout_s=60)
    sync = WeightSync(config, [Engine(url, 1, "cpu")], spec)
    sync.bucket_bytes, sync.transport = BUCKET_BYTES, transport
    try:
        sync.sync(model, version=1)
        error = None
    except WeightSyncError as raised:
        error = str(raised)
    return error, transport.buckets


def reshard_on_rank(rank: int, world_size: int, jobs: list, url: str) -> list:
    """Per job: this rank's buckets from iter_hf_buckets, sent by the sync overlapped and one
    after the other, the outcome of a sync whose second send fails, then of the next sync."""
    from megatron_fr.weights.pipeline import THREAD_NAME
    from megatron_fr.weights.reshard import iter_hf_buckets
    from megatron_fr.weights.sync import is_stage_sender

    results = []
    for megatron_dir, config, kwargs in jobs:
        spec, model = load_learner(megatron_dir, config, ParallelConfig(**kwargs))
        direct = list(iter_hf_buckets(model, spec, BUCKET_BYTES))
        result = dict(direct=direct if is_stage_sender() else None)
        for overlap in (True, False):
            result[f"overlap_{overlap}"] = sync_with(
                model, spec, url, overlap, recording_transport()
            )
        failing = recording_transport(fail_at=SENT_BEFORE_FAILING)
        error, _ = sync_with(model, spec, url, True, failing)
        threads = [t.name for t in threading.enumerate() if t.name.startswith(THREAD_NAME)]
        result["failed"] = (error, failing.attempts, threads)
        result["after_failure"] = sync_with(model, spec, url, True, recording_transport())
        results.append(result)
    return results


@pytest.mark.distributed
def test_reshard_and_sync_from_any_layout_send_the_converter_output(tmp_path):
    jobs, references = [], []
    for family, layouts in RESHARD_LAYOUTS.items():
        config, _, _, _ = tiny_checkpoint(family, tmp_path / family)
        megatron_dir, back = tmp_path / f"{family}.m", tmp_path / f"{family}.back"
        run_on_ranks(_convert_both_ways, 1, str(tmp_path / family), str(megatron_dir), str(back))
        reference = saved_tensors(back)
        for kwargs in layouts:
            jobs.append((str(megatron_dir), config, kwargs))
            references.append((family, kwargs, reference))
    paths = (
        protocol.PAUSE_GENERATION_PATH,
        protocol.UPDATE_WEIGHT_VERSION_PATH,
        protocol.CONTINUE_GENERATION_PATH,
    )
    with StubServer({path: [(200, {"success": True})] for path in paths}) as engine:
        per_rank = run_on_ranks(reshard_on_rank, 4, jobs, engine.url, timeout_s=900)
    for index, (family, layout, reference) in enumerate(references):
        results = [rank_results[index] for rank_results in per_rank]
        direct = sent_by_senders([r["direct"] or [] for r in results], f"{family} {layout}")
        assert direct.keys() == reference.keys(), f"{family} {layout}"
        for name, tensor in reference.items():
            assert torch.equal(direct[name], tensor), f"{family} {layout}: {name} differs"
        for r in results:  # bucket by bucket, the same tensors whichever way they are sent
            for sent in ("overlap_True", "overlap_False", "after_failure"):
                error, buckets = r[sent]
                assert error is None, f"{family} {layout} {sent}: {error}"
                assert_same_buckets(buckets, r["direct"] or [], f"{family} {layout} {sent}")
        failed = [r["failed"] for r in results]
        assert all(error and "injected: bucket 2 lost" in error for error, _, _ in failed), failed
        assert all(threads == [] for _, _, threads in failed), failed
        # The first stage's sender failed; the later stages never sent (stages go in turn).
        attempts = [attempts for _, attempts, _ in failed if attempts]
        assert attempts == [SENT_BEFORE_FAILING], f"{family} {layout}: {attempts}"


def sent_by_senders(per_rank: list[list], what: str) -> dict[str, torch.Tensor]:
    """Every rank's buckets as one dict, checking bucket sizes and that no name is sent twice."""
    sent: dict[str, torch.Tensor] = {}
    for buckets in per_rank:
        for bucket in buckets:
            size = sum(t.numel() * t.element_size() for _, t in bucket)
            assert size <= BUCKET_BYTES or len(bucket) == 1, f"{what}: {size} B"
            for name, tensor in bucket:
                if name in sent:  # DP replicas of a stage send nothing; stages are disjoint
                    raise AssertionError(f"{what}: {name} sent twice")
                sent[name] = tensor
    return sent


def assert_same_buckets(got: list, expected: list, what: str) -> None:
    assert [[n for n, _ in b] for b in got] == [[n for n, _ in b] for b in expected], what
    for bucket, reference in zip(got, expected, strict=True):
        for (name, tensor), (_, wanted) in zip(bucket, reference, strict=True):
            assert tensor.dtype == wanted.dtype and torch.equal(tensor, wanted), f"{what}: {name}"


def _convert_both_ways(rank: int, world_size: int, hf_dir: str, megatron_dir: str, back: str):
    from megatron_fr.convert.checkpoint import megatron_to_hf_checkpoint

    to_megatron_on_rank(rank, world_size, hf_dir, megatron_dir)
    megatron_to_hf_checkpoint(megatron_dir, back, progress=False)


# --- end to end: learner ranks -> gloo broadcast -> CPU engine ---------------------------------


def _generate(url: str, prompt: list[int], seed: int) -> dict:
    body = {
        "input_ids": prompt,
        "sampling_params": {
            "temperature": 1.0,
            "max_new_tokens": 12,
            "ignore_eos": True,
            "sampling_seed": seed,
        },
        "return_logprob": True,
    }
    request = urllib.request.Request(
        url + "/generate", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def hf_log_probs(model, tokens: list[int], prompt_len: int) -> torch.Tensor:
    """log-probs of tokens[prompt_len:] given everything before, by a transformers model that
    holds the learner's weights (the learner's own forward needs every stage at PP > 1)."""
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits
    log_probs = torch.log_softmax(logits[0].float(), dim=-1)
    targets = torch.tensor(tokens[prompt_len:])
    return log_probs[prompt_len - 1 : -1].gather(-1, targets[:, None])[:, 0]


def sync_on_rank(
    rank: int, world_size: int, megatron_dir: str, hf_dir: str, config: dict, url: str, port: int
):
    """At PP2 (one sender per stage, each with its own group to the engine, sending one stage
    after the other): sample from the engine before and after a sync and compare with the
    learner's log-probs. Then a scaled model through the disk transport, then a sync to an
    engine that never answers, which must fail within its timeout."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from megatron_fr.config import WeightSyncConfig
    from megatron_fr.weights.sync import WeightSync, WeightSyncError
    from megatron_fr.weights.transports import Engine

    spec, model = load_learner(megatron_dir, config, ParallelConfig(pipeline=2))
    reference = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    prompt, results = [3, 17, 42, 5], {}

    def sample_and_score(seed: int):
        payload = [None]
        if rank == 0:
            answer = _generate(url, prompt, seed)
            engine_lp = torch.tensor([e[0] for e in answer["meta_info"]["output_token_logprobs"]])
            mine = hf_log_probs(reference, prompt + answer["output_ids"], len(prompt))
            payload = [
                ((mine - engine_lp).abs().max().item(), answer["meta_info"]["weight_version"])
            ]
        dist.broadcast_object_list(payload, src=0)
        return payload[0]

    results["before"] = sample_and_score(seed=1)
    in_flight = _start_long_rollout(url) if rank == 0 else None
    config = WeightSyncConfig(master_port=port, timeout_s=60, spot_check=4, bucket_mib=1)
    sync = WeightSync.from_config(config, [Engine(url)], spec)
    sync.bucket_bytes = 50_000  # several buckets even for this tiny model
    sync.connect()
    report = sync.sync(model, version=7)
    results["report"] = (report.buckets, report.tensors, report.spot_checked)
    results["engines"] = sync.engines
    if in_flight is not None:
        in_flight[0].join(timeout=120)
        results["continued"] = in_flight[1]
    results["after"] = sample_and_score(seed=2)
    sync.close()

    with torch.no_grad():  # a "training step": every HF tensor is a rearrangement of
        for module in (model, reference):  # megatron tensors, so scaling all commutes
            for parameter in module.parameters():
                parameter.mul_(0.9)
    results["stale"] = sample_and_score(seed=3)
    disk_dir = Path(megatron_dir).parent / "sync_dir"
    disk_config = WeightSyncConfig(transport="disk", directory=str(disk_dir), timeout_s=60)
    disk_sync = WeightSync.from_config(disk_config, [Engine(url)], spec)
    disk_sync.sync(model, version=8)  # connects itself
    results["after_disk"] = sample_and_score(seed=4)
    results["disk_files"] = sorted(path.name for path in disk_dir.iterdir())

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen()  # accepts connections, never answers
    dead = [Engine(f"http://127.0.0.1:{silent.getsockname()[1]}", tp_size=1, kind="cpu")]
    started = time.monotonic()
    try:
        dead_config = disk_config.model_copy(update={"timeout_s": 2.0})
        WeightSync.from_config(dead_config, dead, spec).sync(model, version=9)
    except WeightSyncError as error:
        results["dead"] = (str(error), time.monotonic() - started)
    silent.close()
    return results


def _start_long_rollout(url: str):
    """A rollout client request that is still generating when the sync pauses the engine
    (mode "abort"), so the client must continue it under the new version."""
    import asyncio
    import threading

    from megatron_fr.engine.client import RolloutClient, RolloutClientConfig
    from megatron_fr.engine.sglang.protocol import SamplingParams

    result: dict = {}

    async def generate():
        async with RolloutClient(RolloutClientConfig(urls=[url])) as client:
            sampling = SamplingParams(max_new_tokens=4000)
            result["rollout"] = await client.generate([1, 2, 3], sampling)

    thread = threading.Thread(target=lambda: asyncio.run(generate()))
    thread.start()
    time.sleep(1.0)  # generating by now; 4000 tokens take several seconds on a CPU
    return thread, result


@pytest.fixture
def cpu_engine(tmp_path):
    """A CPU engine serving a tiny qwen3_moe (seed 0) on a free port; stopped by its handle."""
    tiny_checkpoint("qwen3_moe", tmp_path / "served")
    port = free_port()
    log = open(tmp_path / "engine.log", "w")  # noqa: SIM115 (closed in teardown)
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "megatron_fr.engine.cpu.server",
            "--model-path",
            str(tmp_path / "served"),
            "--port",
            str(port),
            "--threads",
            "1",
            "--context-length",
            "8192",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(url + "/health", timeout=1).close()
            break
        except OSError:
            assert process.poll() is None, (tmp_path / "engine.log").read_text()
            time.sleep(0.3)
    yield url
    process.kill()
    process.wait()
    log.close()


@pytest.mark.distributed
def test_broadcast_and_disk_sync_make_the_engine_sample_with_the_learner_weights(
    tmp_path, cpu_engine
):
    config, _, _, _ = _trained_checkpoint(tmp_path)
    results_by_rank = run_on_ranks(
        sync_on_rank,
        2,
        str(tmp_path / "learner.m"),
        str(tmp_path / "learner_hf"),
        config,
        cpu_engine,
        free_port(),
        timeout_s=600,
    )
    results = results_by_rank[0]
    before, _ = results["before"]
    after, version = results["after"]
    assert before > 1e-2, f"the engine should start with other weights (max diff {before})"
    assert after <= 1e-5, f"after the sync: max |engine - learner| log-prob {after}"
    assert version == "7"
    (engine,) = results["engines"]  # resolved from the server: the CPU engine, one rank
    assert (engine.tp_size, engine.kind) == (1, "cpu")
    stale, _ = results["stale"]
    after_disk, version = results["after_disk"]
    assert stale > 1e-3 and after_disk <= 1e-5 and version == "8", (stale, after_disk, version)
    # Both stages' files lie directly in the directory SGLang's loader globs, with one index.
    files = results["disk_files"]
    assert "model.safetensors.index.json" in files
    assert {name[:7] for name in files if name.endswith(".safetensors")} == {"stage00", "stage01"}
    rollout = results["continued"]["rollout"]
    versions = rollout.token_versions
    assert len(rollout.output_ids) == len(versions) == 4000 and rollout.continuations >= 1
    switch = versions.index("7")
    assert switch > 0 and set(versions[:switch]) == {"default"} and set(versions[switch:]) == {"7"}
    buckets, tensors, spot_checked = results["report"]
    assert buckets > 2 and tensors == 45 and spot_checked == 4
    message, seconds = results["dead"]
    # the first call of a connect: ending an update session a dead learner may have left open
    assert "end their update session" in message and "127.0.0.1" in message, message
    assert "within 2 s" in message, message
    assert seconds < 10


def _trained_checkpoint(tmp_path: Path):
    """The learner's weights: the same architecture, other random weights (seed 1)."""
    learner_hf = tmp_path / "learner_hf"
    result = tiny_checkpoint("qwen3_moe", learner_hf, seed=1)
    run_on_ranks(to_megatron_on_rank, 1, str(learner_hf), str(tmp_path / "learner.m"))
    return result
