"""Server launching: exact SGLang / CPU-engine command lines, the engine named and never
guessed (SGLang refused on a machine without CUDA), the NCCL setting both ends of the weight
group share, and the process lifecycle (health wait, early exit, deadline, stop) on small
stand-in server processes."""

from __future__ import annotations

import ast
import importlib.util
import os
import signal
import socket
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
import torch
from pydantic import ValidationError

from megatron_fr.cli import build_parser
from megatron_fr.engine.cpu.backend import server_command as cpu_server_command
from megatron_fr.engine.group import NCCL_CUMEM, match_sglang_nccl_env
from megatron_fr.engine.launcher import (
    ServerExited,
    ServerProcess,
    launch_server,
    server_command,
    server_env,
    server_gpus,
)
from megatron_fr.engine.server_config import ServerLaunchConfig
from megatron_fr.engine.sglang import source as src
from megatron_fr.engine.sglang.backend import SGLANG_ENV
from megatron_fr.engine.sglang.backend import server_command as sglang_server_command


def sglang_command(cfg: ServerLaunchConfig) -> list[str]:
    """SGLang's command on GPUs."""
    return sglang_server_command(cfg, has_cuda=lambda: True)


def cpu_engine_command(cfg: ServerLaunchConfig) -> list[str]:
    """The CPU engine's command, started as a child (it watches its parent)."""
    return cpu_server_command(cfg, has_cuda=lambda: False)


MOE_MULTI_NODE = ServerLaunchConfig(
    model_path="/models/Qwen3-30B-A3B",
    host="0.0.0.0",
    port=30000,
    tp_size=8,
    ep_size=8,
    nnodes=2,
    node_rank=1,
    dist_init_addr="10.0.0.1:5000",
    mem_fraction_static=0.8,
    skip_tokenizer_init=True,
    extra_args=["--cuda-graph-max-bs", "256"],
    engine="sglang",
    return_routed_experts=True,
)
DP_ATTENTION = ServerLaunchConfig(
    model_path="Qwen/Qwen3-30B-A3B",
    port=31000,
    tp_size=4,
    ep_size=4,
    dp_size=4,
    enable_dp_attention=True,
)


def test_sglang_command_multi_node_moe() -> None:
    assert sglang_command(MOE_MULTI_NODE) == [
        sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        "/models/Qwen3-30B-A3B",
        "--tp-size",
        "8",
        "--ep-size",
        "8",
        "--mem-fraction-static",
        "0.8",
        "--host",
        "0.0.0.0",
        "--port",
        "30000",
        "--nnodes",
        "2",
        "--node-rank",
        "1",
        "--dist-init-addr",
        "10.0.0.1:5000",
        "--skip-tokenizer-init",
        "--enable-return-routed-experts",
        "--skip-server-warmup",
        "--cuda-graph-max-bs",
        "256",
    ]


def test_sglang_command_dp_attention() -> None:
    assert sglang_command(DP_ATTENTION) == [
        sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        "Qwen/Qwen3-30B-A3B",
        "--tp-size",
        "4",
        "--ep-size",
        "4",
        "--attn-dp-size",
        "4",  # 0.5.23's spelling of --dp-size 4 --enable-dp-attention
        "--mem-fraction-static",
        "0.7",
        "--host",
        "127.0.0.1",
        "--port",
        "31000",
        "--skip-server-warmup",
    ]


def test_sglang_flags_are_sglang_server_args() -> None:
    """Each flag is "--" + a ServerArgs field name with "_" -> "-" (arg_groups/arg_utils.py)."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("sglang is not installed (pip install --no-deps sglang==0.5.23)")
    root = Path(next(iter(spec.submodule_search_locations)))
    assert (root / "launch_server.py").is_file()
    fields = {
        stmt.target.id
        for path in (root / "srt/arg_groups/fields").glob("*.py")
        for node in ast.parse(path.read_text()).body
        if isinstance(node, ast.ClassDef)
        for stmt in node.body
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
    }
    known = {"--" + name.replace("_", "-") for name in fields}
    for cfg in (MOE_MULTI_NODE, DP_ATTENTION):
        ours = sglang_command(cfg)[: len(sglang_command(cfg)) - len(cfg.extra_args)]
        flags = {arg for arg in ours if arg.startswith("--")}
        assert flags <= known, sorted(flags - known)


def test_cpu_engine_command() -> None:
    cfg = ServerLaunchConfig(model_path="/tmp/tiny-qwen3-moe", port=30123, engine="cpu")
    assert cpu_engine_command(cfg) == [
        sys.executable,
        "-m",
        "megatron_fr.engine.cpu.server",
        "--model-path",
        "/tmp/tiny-qwen3-moe",
        "--host",
        "127.0.0.1",
        "--port",
        "30123",
        "--threads",
        "1",
        "--parent-pid",
        str(os.getpid()),
    ]
    assert server_command(cfg) == cpu_engine_command(cfg)
    # `megatron-fr serve` execs the engine in its own place: no parent to watch.
    assert server_command(cfg, watch_parent=False) == cpu_engine_command(cfg)[:-2]
    routed = cfg.model_copy(update={"return_routed_experts": True})
    assert server_command(routed, watch_parent=False)[-1] == "--enable-return-routed-experts"


def test_cpu_engine_refuses_what_it_cannot_honour() -> None:
    with pytest.raises(ValueError, match=r"unsupported: tp_size=8, ep_size=8, nnodes=2, extra"):
        cpu_engine_command(MOE_MULTI_NODE)
    with pytest.raises(ValueError, match="dp_size=4, enable_dp_attention=True"):
        cpu_engine_command(DP_ATTENTION)


def test_the_engine_is_named_never_guessed(tmp_path, capsys) -> None:
    """The command follows the name whatever the machine has; SGLang where CUDA and SGLang's
    CPU environment are missing is refused before anything starts (launch, `megatron-fr
    serve`), never served by the CPU engine instead; `serve` requires the name."""
    no_sglang = str(tmp_path / "no-python")  # no SGLang CPU environment either
    cfg = ServerLaunchConfig(model_path="m", log_dir=tmp_path, python=no_sglang)
    assert cfg.engine == "sglang"
    if torch.cuda.is_available():
        assert server_command(cfg) == sglang_command(cfg)
    cpu = cfg.model_copy(update={"engine": "cpu"})
    assert server_command(cpu) == cpu_engine_command(cpu)
    with pytest.raises(ValidationError, match="engine"):
        ServerLaunchConfig(model_path="m", engine="auto")
    parser = build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--model-path", "m", "--port", "1"])
    assert "the following arguments are required: --engine" in capsys.readouterr().err
    if torch.cuda.is_available():
        return  # the refusals below are for machines without CUDA
    with pytest.raises(ValueError, match="engine is 'sglang', which needs CUDA GPUs"):
        launch_server(cfg)
    assert not (tmp_path / f"server-{cfg.port}.log").exists(), "nothing was started"
    args = parser.parse_args(
        ["serve", "--model-path", "m", "--port", "1", "--engine", "sglang", "--python", no_sglang]
    )
    assert args.run(args) == 2
    assert "--engine is 'sglang', which needs CUDA GPUs" in capsys.readouterr().err


def test_nccl_cumem_is_what_sglang_sets_for_itself(monkeypatch) -> None:
    """SGLang's own statement (srt/entrypoints/engine.py: _set_envs_and_config, run from the
    installed package on its default arguments) and `train`'s give NCCL_CUMEM_ENABLE the
    same value, unset or set by the user; an SGLang server started by the run inherits it."""
    tree = ast.parse(src.function_source("srt/entrypoints/engine.py", "_set_envs_and_config"))
    statement = next(
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and NCCL_CUMEM in ast.unparse(node.test)
    )
    default_args = SimpleNamespace(enable_symm_mem=False)
    for preset in ({}, {NCCL_CUMEM: "1"}, {NCCL_CUMEM: "0"}):
        sglang_env, train_env = dict(preset), dict(preset)
        namespace = {
            "os": SimpleNamespace(environ=sglang_env),
            "cfg": default_args,
            "kv_shard_symmetric_scratch": False,
            "logger": None,
        }
        exec(compile(ast.Module([statement], []), "<sglang>", "exec"), namespace)
        assert match_sglang_nccl_env(train_env) == sglang_env[NCCL_CUMEM] == train_env[NCCL_CUMEM]
    monkeypatch.setenv(NCCL_CUMEM, "unset below; restored after the test")
    monkeypatch.delenv(NCCL_CUMEM)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    match_sglang_nccl_env()
    env = server_env(ServerLaunchConfig(model_path="m"))
    assert env[NCCL_CUMEM] == os.environ[NCCL_CUMEM] == "0"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"tp_size": 4, "ep_size": 3}, "ep_size 3 must divide tp_size 4"),
        ({"tp_size": 4, "enable_dp_attention": True}, "enable_dp_attention needs dp_size > 1"),
        ({"tp_size": 4, "dp_size": 3, "enable_dp_attention": True}, "got dp_size 3"),
        ({"nnodes": 2, "node_rank": 2, "dist_init_addr": "h:1"}, "node_rank 2 must be < nnodes 2"),
        ({"nnodes": 2}, "dist_init_addr"),
        ({"mem_fraction_static": 1.0}, "mem_fraction_static"),
        ({"port": 0}, "port"),
        ({"engine": "tgi"}, "engine"),
        ({"engine": "auto"}, "engine"),
        ({"gpus": 8}, "gpus"),
    ],
)
def test_launch_config_refuses_bad_layouts(kwargs: dict, match: str) -> None:
    with pytest.raises(ValidationError, match=match):
        ServerLaunchConfig(model_path="m", **kwargs)


def test_sglang_goes_on_the_gpus_after_the_learners_under_torchrun() -> None:
    tp2 = ServerLaunchConfig(model_path="m", tp_size=2, engine="sglang")
    assert server_gpus(tp2, {}, 8) == []  # standalone: all visible GPUs, as SGLang's default
    assert server_gpus(tp2, {"LOCAL_WORLD_SIZE": "4"}, 8) == ["4", "5"]
    # Entries of the parent's own CUDA_VISIBLE_DEVICES, in its order.
    narrowed = {"LOCAL_WORLD_SIZE": "2", "CUDA_VISIBLE_DEVICES": "2,3,5,7,9"}
    assert server_gpus(tp2, narrowed, 0) == ["5", "7"]
    colocated = tp2.model_copy(update={"gpu_ids": (0, 1)})
    assert server_gpus(colocated, {"LOCAL_WORLD_SIZE": "2"}, 2) == ["0", "1"]
    with pytest.raises(ValueError, match=r"7 rank\(s\) on this node use GPUs 0\.\.6 of 8"):
        server_gpus(tp2, {"LOCAL_WORLD_SIZE": "7"}, 8)
    with pytest.raises(ValueError, match=r"gpu_ids \[9\] not among the 8 visible"):
        server_gpus(tp2.model_copy(update={"gpu_ids": (0, 9)}), {}, 8)
    with pytest.raises(ValidationError, match=r"SGLang uses 4 GPU\(s\) per node"):
        ServerLaunchConfig(model_path="m", tp_size=2, dp_size=2, gpu_ids=(0, 1))


def test_started_sglang_servers_answer_health_without_generating(monkeypatch) -> None:
    """SGLang's /health (read from the installed package) generates unless its EnvBool reads
    SGLANG_ENV's value as false; servers started here get that value, a user's own is kept."""
    ((name, value),) = SGLANG_ENV.items()
    health = src.function_source("srt/entrypoints/http_server.py", "health_generate")
    assert f"not envs.{name}.get()" in health and "return Response(status_code=200)" in health
    parse = src.exec_function(
        src.function_source("srt/environ.py", "parse", "EnvBool"), "parse", {}
    )
    assert parse(None, value) is False
    monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert server_env(ServerLaunchConfig(model_path="m", engine="sglang"))[name] == value
    assert name not in server_env(ServerLaunchConfig(model_path="m", engine="cpu"))
    monkeypatch.setenv(name, "1")
    assert server_env(ServerLaunchConfig(model_path="m", engine="sglang"))[name] == "1"


def test_server_env_narrows_cuda_visible_devices_for_sglang_only(monkeypatch) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "6,7")
    monkeypatch.setattr("megatron_fr.engine.launcher._has_cuda", lambda: True)  # SGLang on GPUs
    env = server_env(ServerLaunchConfig(model_path="m", engine="sglang"))
    assert env["CUDA_VISIBLE_DEVICES"] == "7" and "LOCAL_RANK" not in env
    assert server_env(ServerLaunchConfig(model_path="m", engine="cpu"))["CUDA_VISIBLE_DEVICES"] == (
        "6,7"
    )


# Stand-in servers: tiny Python processes with the lifecycle of a real one.
HEALTHY_AFTER_DELAY = """
import http.server, sys, time
print("loading weights", flush=True)
time.sleep(float(sys.argv[2]))
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""
STUBBORN_WITH_CHILD = """
import signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"])
print("child", child.pid, flush=True)
time.sleep(60)
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _gone(pid: int) -> bool:
    """No such process, or only its zombie entry (dead, waiting for init to reap it)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.fixture
def start(tmp_path: Path):
    """ServerProcess.start on a free port; every server started is stopped at teardown."""
    servers: list[ServerProcess] = []

    def start_(script: str, *args: str) -> ServerProcess:
        port = _free_port()
        command = [sys.executable, "-c", script, str(port), *args]
        server = ServerProcess.start(command, "0.0.0.0", port, tmp_path / "logs")
        servers.append(server)
        return server

    yield start_
    for server in servers:
        server.stop(timeout_s=5)


def test_wait_healthy_once_the_server_answers(start) -> None:
    server = start(HEALTHY_AFTER_DELAY, "0.3")
    assert server.url.startswith("http://127.0.0.1:")
    began = time.monotonic()
    server.wait_healthy(deadline_s=20)
    assert time.monotonic() - began >= 0.3
    assert server.log_path.name == f"server-{server.url.rsplit(':', 1)[1]}.log"
    assert "loading weights" in server.log_path.read_text()
    assert server.stop(timeout_s=5) == -15  # SIGTERM
    assert _gone(server.pid)


def test_wait_healthy_reports_an_early_exit(start) -> None:
    server = start("import sys; print('CUDA error: no device', flush=True); sys.exit(3)")
    with pytest.raises(ServerExited, match="exit code 3") as info:
        server.wait_healthy(deadline_s=20)
    assert "CUDA error: no device" in str(info.value)
    assert str(server.log_path) in str(info.value)


def test_wait_healthy_deadline(start) -> None:
    server = start(HEALTHY_AFTER_DELAY, "60")
    began = time.monotonic()
    with pytest.raises(TimeoutError, match=r"not healthy after 0.5 s") as info:
        server.wait_healthy(deadline_s=0.5)
    assert time.monotonic() - began < 0.5 + 1.0
    assert info.value.args[0].endswith("loading weights")  # the log's tail


def test_stop_leaves_no_process_behind(start) -> None:
    server = start(STUBBORN_WITH_CHILD)
    deadline = time.monotonic() + 20
    while "child" not in server.log_tail() and time.monotonic() < deadline:
        time.sleep(0.05)
    child = int(server.log_tail().split("child ")[1].split()[0])
    assert not _gone(server.pid) and not _gone(child)
    began = time.monotonic()
    assert server.stop(timeout_s=0.5) == -9  # it ignored SIGTERM
    assert time.monotonic() - began < 0.5 + 2.0
    assert _gone(server.pid) and _gone(child)
    assert server.stop() == -9  # a second stop is harmless


def test_a_stopped_server_ends_at_its_sigterm_not_at_the_timeout(start) -> None:
    """A server SIGSTOPped (hung in the kernel's eyes: it acts on no signal but SIGKILL until
    continued) is continued after the SIGTERM, so it ends by that SIGTERM at once instead of
    holding the run's end for the whole grace period."""
    server = start(HEALTHY_AFTER_DELAY, "0.1")
    server.wait_healthy(deadline_s=20)
    os.kill(server.pid, signal.SIGSTOP)
    began = time.monotonic()
    assert server.stop(timeout_s=20) == -15  # SIGTERM, not the SIGKILL after the grace
    assert time.monotonic() - began < 5.0
    assert _gone(server.pid)


def test_the_pool_starts_count_engines_on_consecutive_ports_and_gpu_blocks(tmp_path) -> None:
    """rollout.engine.count engines besides the URLs (one when there are none); SGLang server r
    takes the r-th block of tp_size GPUs, from gpu_ids or after the learner's."""
    from megatron_fr.config.rollout import EngineSettings
    from megatron_fr.rollout.supervisor import launch_configs

    assert (EngineSettings().started, EngineSettings(urls=["http://a:1"]).started) == (1, 0)
    both = EngineSettings(urls=["http://a:1"], count=2, kind="sglang", tp_size=2, port=31000)
    configs = launch_configs(both, tmp_path, tmp_path, routed_experts=False)
    assert [(c.port, c.replica, c.gpu_ids) for c in configs] == [(31000, 0, ()), (31001, 1, ())]
    assert [server_gpus(c, {"LOCAL_WORLD_SIZE": "2"}, 8) for c in configs] == [
        ["2", "3"],
        ["4", "5"],
    ]
    with pytest.raises(ValueError, match=r"SGLang needs 6 more"):
        server_gpus(configs[1].model_copy(update={"replica": 2}), {"LOCAL_WORLD_SIZE": "2"}, 7)
    given = both.model_copy(update={"gpu_ids": (7, 6, 5, 4)})
    assert [c.gpu_ids for c in launch_configs(given, tmp_path, tmp_path, False)] == [(7, 6), (5, 4)]
    with pytest.raises(ValidationError, match=r"2 engine\(s\) at tp_size 2 take 4 GPU ids"):
        EngineSettings(count=2, tp_size=2, gpu_ids=(0, 1))
    with pytest.raises(ValidationError, match="count 0 and no urls"):
        EngineSettings(count=0)
