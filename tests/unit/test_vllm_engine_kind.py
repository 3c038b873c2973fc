"""vLLM as an engine kind, the parts that need no vLLM: a recipe asking of vLLM what the
project does not read from it is refused naming the setting; a vLLM /server_info answer
(its dev-mode shape: {"vllm_config": {...}}) is read into the same ServerInfo as SGLang's; the
wire, the transport and the rollout client are chosen by kind; a pool mixing wires is refused.
The same pieces against a real vLLM server: tests/vllm/."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from megatron_fr.config.rollout import EngineSettings
from megatron_fr.config.run import load_run_config
from megatron_fr.config.weights import WeightSyncConfig
from megatron_fr.engine.backends import BACKENDS, backend_for
from megatron_fr.engine.server_info import ServerInfo, UnknownServer, parse_server_info
from megatron_fr.engine.sglang.wire import SGLANG_WIRE
from megatron_fr.engine.vllm.wire import VLLM_WIRE, UnsupportedByVllm
from megatron_fr.rollout.supervisor import EngineRefused, EngineSupervisor
from megatron_fr.weights.transports import Engine, build_transport
from megatron_fr.weights.transports.disk import DiskTransport
from megatron_fr.weights.transports.distributed import DistributedTransport

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "examples" / "cpu_dense_vllm.yaml"


def vllm_answer(tp: int = 2, pp: int = 1, dp: int = 1) -> dict:
    parallel = {"tensor_parallel_size": tp, "pipeline_parallel_size": pp, "data_parallel_size": dp}
    return {"vllm_config": {"parallel_config": parallel}, "vllm_env": {}, "system_env": {}}


def test_the_vllm_recipe_loads_and_what_vllm_cannot_serve_is_refused_by_name():
    assert load_run_config(RECIPE, []).rollout.engine.kind == "vllm"
    for override, named in [
        ("learner.routing_replay=true", "learner.routing_replay"),
        ("learner.flash_reinforce.gate_kl=topk", "learner.flash_reinforce.gate_kl=topk"),
        ("weights.pause_mode=retract", "weights.pause_mode=retract"),
        ("weights.spot_check=2", "weights.spot_check"),
        ("weights.transport=tensor", "weights.transport=tensor"),
    ]:
        with pytest.raises(ValueError, match=f"kind vllm with {named}"):
            load_run_config(RECIPE, [override])


def test_a_vllm_server_info_is_read_into_its_sizes():
    info = parse_server_info("http://h:1", vllm_answer(tp=2, pp=1, dp=3))
    assert info == ServerInfo("http://h:1", "vllm", 2, 1, 3, False)
    with pytest.raises(UnknownServer, match="parallel_config is not an object"):
        parse_server_info("http://h:1", {"vllm_config": {}})
    with pytest.raises(UnknownServer, match="tensor_parallel_size must be a positive int"):
        parse_server_info("http://h:1", vllm_answer(tp=0))


def test_the_wire_is_chosen_by_kind_and_refuses_what_vllm_lacks():
    assert backend_for("vllm").wire is VLLM_WIRE and backend_for("sglang").wire is SGLANG_WIRE
    assert backend_for("cpu").wire is SGLANG_WIRE and backend_for(None).wire is SGLANG_WIRE
    assert set(BACKENDS) == {"sglang", "vllm", "cpu"}
    assert VLLM_WIRE.version_path == "/weight_info" and SGLANG_WIRE.version_path == "/model_info"
    with pytest.raises(UnsupportedByVllm, match="retract"):
        VLLM_WIRE.pause("http://127.0.0.1:9", "retract", 1.0)
    from megatron_fr.engine.sglang.protocol import SamplingParams

    with pytest.raises(UnsupportedByVllm, match="routing replay"):
        VLLM_WIRE.generate_request(
            [1], SamplingParams(max_new_tokens=2), routed_experts_start_len=0
        )


def test_vllm_engines_get_the_vllm_transport_and_nothing_else():
    """vLLM's servers take the broadcast over gloo whatever weights.backend says, and the
    disk reload, each through vLLM's wire; the tensor transport is refused."""
    engines = [Engine("http://h:1", tp_size=2, kind="vllm")]
    transport = build_transport(WeightSyncConfig(backend="nccl"), engines)
    assert type(transport) is DistributedTransport and transport.backend == "gloo"
    assert transport.wire is VLLM_WIRE
    path, bodies = transport.join_requests("10.0.0.1", 29500, ["weight_update_group_pp0_e0"])
    assert path == "/init_weight_transfer_engine"
    assert bodies[0]["init_info"] == {
        "master_address": "10.0.0.1",
        "master_port": 29500,
        "rank_offset": 1,
        "world_size": 3,
        "group_name": "weight_update_group_pp0_e0",
        "timeout_s": transport.timeout_s,
    }
    sglang = build_transport(WeightSyncConfig(), [Engine("http://h:1", tp_size=2, kind="sglang")])
    assert type(sglang) is DistributedTransport
    disk = build_transport(WeightSyncConfig(transport="disk", directory="/tmp/w"), engines)
    assert type(disk) is DiskTransport and disk.wire is VLLM_WIRE
    with pytest.raises(ValueError, match="vLLM engines receive weights by distributed or disk"):
        build_transport(WeightSyncConfig(transport="tensor"), engines)
    with pytest.raises(ValueError, match="vLLM with pp_size 2"):
        build_transport(
            WeightSyncConfig(), [Engine("http://h:1", tp_size=1, kind="vllm", pp_size=2)]
        ).check_engines()


def test_a_pool_speaks_one_wire():
    settings = EngineSettings(urls=["http://a:1", "http://b:2"])
    pool = EngineSupervisor(settings, [])
    assert pool._fit(ServerInfo("http://a:1", "vllm", 1, 1, 1, False), False).kind == "vllm"
    assert pool.kind == "vllm" and pool.wire is VLLM_WIRE
    with pytest.raises(EngineRefused, match="is a cpu server and the pool's engines are vllm"):
        pool._fit(ServerInfo("http://b:2", "cpu", 1, 1, 1, False), False)
    mixed_ok = EngineSupervisor(settings, [])
    mixed_ok._fit(ServerInfo("http://a:1", "sglang", 1, 1, 1, False), False)
    mixed_ok._fit(ServerInfo("http://b:2", "cpu", 1, 1, 1, False), False)  # one wire
    assert mixed_ok.wire is SGLANG_WIRE


def test_serve_runs_vllm_with_the_projects_flags_and_environment(tmp_path):
    """`megatron-fr serve --engine vllm` (what the Slurm job runs per server) becomes vLLM's
    server with the flags and the environment the project needs of it."""
    fake = tmp_path / "python"  # stands in for vLLM's interpreter: says how it was started
    fake.write_text('#!/bin/sh\necho "DEV=$VLLM_SERVER_DEV_MODE PYTHONPATH=$PYTHONPATH $*"\n')
    fake.chmod(0o755)
    command = [sys.executable, "-m", "megatron_fr", "serve", "--engine", "vllm"]
    command += ["--python", str(fake), "--model-path", "/m", "--port", "20100", "--", "--x"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert result.returncode == 0, result.stderr
    started = result.stdout.splitlines()[-1]
    assert started.startswith(f"DEV=1 PYTHONPATH={REPO}")
    assert "-m vllm.entrypoints.openai.api_server --model /m --host 0.0.0.0 --port 20100" in started
    for flag in ("--enable-scale-out", "--worker-extension-cls", "--x"):
        assert flag in started


def test_a_vllm_run_without_vllm_is_refused_before_anything_starts(tmp_path, demo_model):
    """The interpreter named by rollout.engine.python must have vLLM (this one has not)."""
    command = [sys.executable, "-m", "megatron_fr", "train", str(RECIPE), "--run-dir"]
    command += [str(tmp_path / "run"), f"rollout.engine.python={sys.executable}"]
    command += [f"model.hf_dir={demo_model}"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert result.returncode == 2, result.stderr
    assert f"rollout.engine.kind vllm: {sys.executable} has no vLLM" in result.stderr
    assert not (tmp_path / "run" / "logs").exists()
