"""Syncs that verify themselves (weights/verify.py), against a real CPU engine and a real
learner: an engine holding the learner's weights passes the probe with a gap of float32
rounding; the same engine after a push of other weights behind the learner's back (a
checkpoint of another seed loaded from disk, with the version set as a correct sync would)
fails it with a gap thousands of times larger, and the pool takes it out naming the gap.
The top-K gate's probe asks for the engine's top-K too and carries them to the learner. A
learner with routing replay on scores the probe (which carries no routed experts) with its
own routing, as the run's check does.
An engine that serves another version fails too, whatever its weights."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_weight_sync import cpu_engine  # noqa: F401  (the fixture)
from tiny_qwen import tiny_checkpoint

from megatron_fr.engine.sglang import protocol
from megatron_fr.parallel.spawn import run_on_ranks

TOLERANCE = 0.05
"""nats: a random tiny model's distributions are nearly flat, so other weights move its
log-probs by tenths, not the whole nats of a trained model's (weights.verify_tolerance's
default, 1, is for those)."""


def _post(url: str, path: str, body: dict) -> None:
    request = urllib.request.Request(
        url + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    urllib.request.urlopen(request, timeout=120).close()


class RecordingPool:
    """Stands in for the rollout process behind PoolSync: records what it is told to take
    out (PoolSync's decision is what is tested)."""

    def __init__(self) -> None:
        self.taken_out: list[tuple[list[str], str]] = []

    def synced(self, urls: list[str], version: int) -> None:
        pass

    def take_out(self, urls: list[str], cause: str) -> None:
        self.taken_out.append((urls, cause))


def check_on_rank(rank: int, world_size: int, hf_dir: str, other_dir: str, url: str) -> dict:
    import functools
    import json as json_module

    from megatron_fr.config import LearnerConfig, ParallelConfig
    from megatron_fr.engine.sglang.wire import SGLANG_WIRE
    from megatron_fr.learner.trainer import Learner
    from megatron_fr.models.hf_config import load_hf_config
    from megatron_fr.orchestrator.pool_sync import PoolSync
    from megatron_fr.parallel import state
    from megatron_fr.weights.verify import SyncCheck

    parallel = ParallelConfig()
    state.initialize(parallel, seed=0)
    spec = load_hf_config(json_module.loads((Path(hf_dir) / "config.json").read_text()))
    config = LearnerConfig(params_dtype="float32")
    learner = Learner(spec, parallel, config, total_steps=1, init_hf_dir=hf_dir)
    check = SyncCheck(learner.policy_log_probs, spec.vocab_size, 1.0, 1, TOLERANCE, 120.0)
    version = protocol.update_weight_version_request
    _post(url, protocol.UPDATE_WEIGHT_VERSION_PATH, version("0"))
    results = {"same": check.run([url], 0)}
    # the run's check under routing replay (controller.sync_check): the probe carries no
    # routed experts, and the learner scores it with its own routing
    replaying = Learner(
        spec,
        parallel,
        LearnerConfig(params_dtype="float32", routing_replay=True),
        total_steps=1,
        init_hf_dir=hf_dir,
    )
    score = functools.partial(replaying.policy_log_probs, routing_replay=False)
    results["same, routing replay"] = SyncCheck(
        score, spec.vocab_size, 1.0, 1, TOLERANCE, 120.0
    ).run([url], 0)
    with_top_k = SyncCheck(
        learner.policy_log_probs, spec.vocab_size, 1.0, 1, TOLERANCE, 120.0, top_logprobs_num=4
    )
    probe = with_top_k._probe([url], 0, SGLANG_WIRE)[0]  # the CPU engine speaks SGLang's
    results["top-K probe rows"] = None if isinstance(probe, str) else probe.top_logprobs
    results["same, top-K"] = with_top_k.run([url], 0)
    _post(
        url,
        protocol.UPDATE_WEIGHTS_FROM_DISK_PATH,
        protocol.update_weights_from_disk_request(other_dir),
    )
    _post(url, protocol.UPDATE_WEIGHT_VERSION_PATH, version("1"))
    results["corrupted"] = check.run([url], 1)
    results["stale version"] = check.run([url], 2)

    pool = RecordingPool()
    speaks_sglang = SimpleNamespace(wire=SGLANG_WIRE)  # the weight sync: only its engines' wire
    sync = PoolSync(None, speaks_sglang, pool, check)  # type: ignore[arg-type]  # its check alone
    sync._verify([url], 1)
    results["taken out"] = pool.taken_out
    results["metrics"] = sync.check_metrics()
    return results


@pytest.mark.distributed
def test_a_push_of_other_weights_is_caught_by_the_probe(tmp_path, cpu_engine, capfd):  # noqa: F811
    served, other = tmp_path / "served", tmp_path / "other"  # the fixture serves seed 0
    tiny_checkpoint("qwen3_moe", other, seed=1)
    (results,) = run_on_ranks(check_on_rank, 1, str(served), str(other), cpu_engine)
    (same,) = results["same"]
    assert same.problem is None and same.tokens > 0 and same.gap < 1e-4, same
    (replayed,) = results["same, routing replay"]  # R3 on: the same check, the same gap
    assert replayed.problem is None and replayed.gap < 1e-4, replayed
    (same_top_k,) = results["same, top-K"]  # the top-K gate's probe: the same check passes
    assert same_top_k.problem is None and same_top_k.gap < 1e-4, same_top_k
    rows = results["top-K probe rows"]  # and carries K entries per generated token
    assert rows is not None and rows.ids.shape == (same_top_k.tokens, 4), rows
    (corrupted,) = results["corrupted"]
    assert corrupted.gap > 1000 * same.gap and corrupted.gap > TOLERANCE, corrupted
    assert f"exceeds weights.verify_tolerance={TOLERANCE:g}" in corrupted.problem
    (stale,) = results["stale version"]
    assert stale.problem == "serves weight version 1, not 2" and stale.tokens == 0
    ((urls, cause),) = results["taken out"]
    assert urls == [cpu_engine] and cause.startswith("sync check: log-prob gap ")
    assert results["metrics"]["sync_checks_failed"] == 1.0
    assert results["metrics"]["sync_logprob_gap"] == pytest.approx(corrupted.gap)
    print(f"\nsync check gaps: own weights {same.gap:.2e}, other weights {corrupted.gap:.3f}")
