"""A recipe + cluster options -> one resolved, checked Slurm job, and its batch script.

    SlurmOptions (nodes, GPUs, servers, container, time) ─► resolve_job(recipe, run_dir, ...)
        loads the recipe with the overrides, checks the learner layout with the planner
        (launch/plan.py) and the split, so a bad job fails here, before it waits for nodes
    SlurmJob ─► render_script(job): #SBATCH lines + MFR_* settings + slurm/job.sh (the body,
        plain bash: it places the steps on the nodes Slurm gave, at run time)

The node split: the first `rollout_nodes` nodes run the inference servers (`megatron-fr serve`,
`servers_per_node` each, on `server_gpus` GPUs each), the remaining `learner_nodes` run one
torchrun each with `procs_per_node` learner ranks (`megatron-fr train`). Each of these is the
recipe's own (its `cluster:` section and `learner_ranks`, config/cluster.py) unless a flag
gives it: a flag overrides the recipe, goes to the run as the dotted override of that key (so
the run's config.yaml says what ran), and a flag and a dotted override of the same key that
disagree are refused, naming both.
"""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, PositiveInt

from megatron_fr.config.engine_kinds import EngineKind, capabilities
from megatron_fr.config.run import RunConfig, load_run_config
from megatron_fr.launch.plan import DEFAULT_RESERVE_GIB, LayoutError, Plan, describe, plan_layout
from megatron_fr.models.hf_config import HFModelSpec, load_hf_config

REPO_ROOT = Path(__file__).resolve().parents[2]
JOB_BODY = REPO_ROOT / "slurm" / "job.sh"
SERVER_PORT_OFFSET = 100
"""Server j listens on port_base + 100 + j (slurm/job.sh); torchrun and the weight group use
port_base and port_base + 10 (+ pipeline stage)."""
NCCL_ENV = (
    # The weight-update group joins learner rank 0 and every SGLang rank, processes that did not
    # start together; NCCL's cuMem buffers are not shareable across them (SGLang's RL users
    # turn them off for this group).
    "NCCL_CUMEM_ENABLE=0",
    # megatron orders its TP / sequence-parallel communication on one hardware queue.
    "CUDA_DEVICE_MAX_CONNECTIONS=1",
)


class LaunchError(ValueError):
    """A job that would fail on the cluster; the message says why."""


class SlurmOptions(BaseModel):
    """Where and how a recipe runs on a Slurm cluster (each field's docstring is its --help)."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    rollout_nodes: PositiveInt | None = None
    """Nodes 1..R of the job: inference servers; None: the recipe's cluster.rollout_nodes."""
    learner_nodes: PositiveInt | None = None
    """Nodes R+1..R+L: learner ranks (one torchrun each); None: the recipe's
    cluster.learner_nodes."""
    gpus_per_node: NonNegativeInt | None = None
    """0: CPU nodes (the CPU engine and gloo learner ranks); None: the recipe's
    cluster.gpus_per_node."""
    procs_per_node: PositiveInt | None = None
    """Learner ranks per learner node; None: the recipe's learner_ranks."""
    server_gpus: NonNegativeInt | None = None
    """GPUs per inference server (its SGLang TP size); None: the recipe's cluster.server_gpus
    (None there: all of a node's GPUs)."""
    engine: EngineKind | None = None
    """The servers' engine; None: the recipe's rollout.engine.kind."""
    server_threads: PositiveInt = 1
    """torch threads of the CPU engine."""
    server_args: tuple[str, ...] = ()
    """Further SGLang or vLLM flags, verbatim (megatron-fr serve ... -- ARGS)."""
    port_base: int = Field(default=20000, ge=1024, le=60000)
    """torchrun at +0, the weight group at +10 (+ stage), server j at +100+j."""
    python: str | None = None
    """Interpreter on the nodes; None: this one (python in a container)."""
    job_name: str = "megatron-fr"
    """sbatch --job-name."""
    partition: str | None = None
    """sbatch --partition."""
    account: str | None = None
    """sbatch --account."""
    time: str | None = None
    """Slurm time limit (e.g. 04:00:00); the job is signalled signal_lead_s before it."""
    signal_lead_s: PositiveInt = 300
    """USR1 this long before the time limit: enough for one step and its checkpoint
    (Slurm may send it up to a minute earlier)."""
    exclusive: bool = False
    """Whole nodes: all their CPUs and memory (sbatch --exclusive --mem=0)."""
    cpus_per_node: PositiveInt | None = None
    """CPUs per node (sbatch --cpus-per-task, one task per node; every step gets them all);
    required unless exclusive: without it Slurm gives a shared node's job one CPU."""
    mem_per_node_gb: float | None = Field(default=None, gt=0)
    """Memory per node in GiB (sbatch --mem); required unless exclusive (without it the job
    gets the partition's default, often a few GB)."""
    container_image: str | None = None
    """pyxis/enroot image; the container flags go to every srun only when this is set."""
    container_mounts: str | None = None
    """pyxis --container-mounts (SRC:DST[,...]): the run directory must be among them."""
    container_workdir: str | None = None
    """pyxis --container-workdir."""
    env: tuple[str, ...] = ()
    """KEY=VALUE exported to every step (after the NCCL defaults, so they can be overridden)."""
    sbatch_args: tuple[str, ...] = ()
    """Further #SBATCH flags, verbatim (e.g. --qos=high)."""
    model: str | None = None
    """Preset or HF dir for the planner; None: the recipe's model.hf_dir."""
    gpu_mem_gb: float | None = Field(default=None, gt=0)
    """GPU memory in GiB: with it the learner layout must fit with the recipe's
    learner.recompute."""
    reserve_gb: float = Field(default=DEFAULT_RESERVE_GIB, ge=0)
    """GiB per GPU kept free for the CUDA context, NCCL and fragmentation (a rule of thumb)."""
    health_timeout_s: PositiveInt = 1800
    """How long the servers may take to load the model and answer /health."""


@dataclass(frozen=True)
class SlurmJob:
    """Everything the batch script needs, resolved and checked."""

    recipe: Path
    run_dir: Path
    overrides: tuple[str, ...]
    options: SlurmOptions
    config: RunConfig
    plan: Plan
    engine: EngineKind
    procs_per_node: int
    server_gpus: int
    servers_per_node: int
    python: str

    @property
    def nodes(self) -> int:
        return self.config.cluster.rollout_nodes + self.config.cluster.learner_nodes

    @property
    def learner_ranks(self) -> int:
        return self.config.learner_world

    @property
    def server_ports(self) -> list[int]:
        count = self.config.cluster.rollout_nodes * self.servers_per_node
        first = self.options.port_base + SERVER_PORT_OFFSET
        return list(range(first, first + count))


def resolve_job(
    recipe: str | Path, run_dir: str | Path, overrides: list[str], options: SlurmOptions
) -> SlurmJob:
    """The job `options` describe for `recipe`; LaunchError names what would fail."""
    recipe, run_dir = Path(recipe).resolve(), Path(run_dir).resolve()
    for path in (recipe, run_dir):
        if any(c.isspace() for c in str(path)):
            raise LaunchError(f"{path}: paths with whitespace cannot go into #SBATCH lines")
    placed = flag_overrides(options, overrides)
    overrides = [*overrides, *placed]
    try:
        config = load_run_config(recipe, overrides)
    except (ValueError, FileNotFoundError) as error:
        raise LaunchError(f"recipe {recipe}: {error}") from None
    cluster = config.cluster
    options = options.model_copy(
        update=dict(
            rollout_nodes=cluster.rollout_nodes,
            learner_nodes=cluster.learner_nodes,
            gpus_per_node=cluster.gpus_per_node,
            procs_per_node=config.learner_ranks,
            server_gpus=options.server_gpus or cluster.server_gpus,
        )
    )
    procs, world = config.learner_ranks, config.learner_world
    if config.weights.transport == "tensor":
        raise LaunchError(
            "weights.transport 'tensor' needs engines on the learner's GPUs; this launcher puts "
            "the servers on nodes of their own (use 'distributed', or 'disk' on a shared path)"
        )
    _check_node_share(options, procs)
    server_gpus, servers_per_node = _servers(options)
    engine = options.engine or config.rollout.engine.kind
    kind = capabilities(engine)
    if kind.server_gpus == "none" and server_gpus:
        raise LaunchError(
            f"{kind.name} (rollout.engine.kind, or --engine) takes no GPUs: "
            "server_gpus must be 0, or serve with --engine sglang"
        )
    if kind.server_gpus == "required" and not server_gpus:
        raise LaunchError(
            f"{kind.name} needs GPUs and gpus_per_node is 0: give "
            "--gpus-per-node, or serve with --engine cpu (or rollout.engine.kind=cpu)"
        )
    last_port = options.port_base + SERVER_PORT_OFFSET + cluster.rollout_nodes * servers_per_node
    if last_port > 65535:
        raise LaunchError(f"port_base {options.port_base}: server ports would pass 65535")
    plan = _plan(config, options, world)
    python = options.python or ("python" if options.container_image else sys.executable)
    return SlurmJob(
        recipe=recipe,
        run_dir=run_dir,
        overrides=tuple(overrides),
        options=options,
        config=config,
        plan=plan,
        engine=engine,
        procs_per_node=procs,
        server_gpus=server_gpus,
        servers_per_node=servers_per_node,
        python=python,
    )


FLAG_KEYS = {
    "rollout_nodes": "cluster.rollout_nodes",
    "learner_nodes": "cluster.learner_nodes",
    "gpus_per_node": "cluster.gpus_per_node",
    "server_gpus": "cluster.server_gpus",
    "procs_per_node": "learner_ranks",
}
"""The launcher's flags that override a recipe setting: option -> the recipe's dotted key."""


def flag_overrides(options: SlurmOptions, overrides: list[str]) -> list[str]:
    """The flags given, as the recipe's dotted overrides; LaunchError naming both when a flag
    and a dotted override of the same key disagree."""
    from megatron_fr.config.run import parse_yaml

    given: dict[str, object] = {}
    for item in overrides:
        key, sep, text = item.partition("=")
        if sep and key in FLAG_KEYS.values():
            try:
                given[key] = parse_yaml(text)
            except Exception:  # the recipe's loader names a bad value
                given[key] = text
    placed = []
    for field, key in FLAG_KEYS.items():
        value = getattr(options, field)
        if value is None or (field == "server_gpus" and value == 0):
            continue
        if key in given and given[key] != value:
            raise LaunchError(
                f"--{field.replace('_', '-')} {value} and the override {key}={given[key]} "
                "disagree: give one of them"
            )
        placed.append(f"{key}={value}")
    return placed


def _check_node_share(options: SlurmOptions, procs: int) -> None:
    if options.exclusive:
        return
    if options.cpus_per_node is None or options.mem_per_node_gb is None:
        raise LaunchError(
            "a job that shares its nodes must say what it needs of each: --cpus-per-node N "
            "--mem-per-node-gb M (or --exclusive for whole nodes)"
        )
    if options.cpus_per_node < procs:
        raise LaunchError(
            f"cpus_per_node {options.cpus_per_node} < {procs} learner rank(s) per node"
        )


def _servers(options: SlurmOptions) -> tuple[int, int]:
    """(GPUs per server, servers per rollout node)."""
    gpus = options.gpus_per_node
    if not gpus:
        if options.server_gpus:
            raise LaunchError(f"server_gpus {options.server_gpus} on nodes without GPUs")
        return 0, 1
    per_server = options.server_gpus or gpus
    if gpus % per_server:
        raise LaunchError(f"server_gpus {per_server} does not divide gpus_per_node {gpus}")
    return per_server, gpus // per_server


def model_spec(config: RunConfig, options: SlurmOptions) -> HFModelSpec:
    """What the planner checks: --model, else the recipe's model.hf_dir."""
    if options.model is not None:
        source = options.model
    else:
        source = config.model.hf_dir
        if not (Path(source) / "config.json").is_file():
            raise LaunchError(
                f"model.hf_dir {source} has no config.json here; pass the model's preset "
                "(--model) so the layout can be checked before submitting"
            )
    try:
        return load_hf_config(source)
    except (FileNotFoundError, ValueError) as error:
        raise LaunchError(f"model {source}: {error}") from None


def _plan(config: RunConfig, options: SlurmOptions, world: int) -> Plan:
    spec = model_spec(config, options)
    try:
        plan = plan_layout(
            spec,
            config.parallel,
            world,
            micro_batch_tokens=config.learner.micro_batch_tokens,
            params_dtype=config.learner.params_dtype,
            gpu_mem_gib=options.gpu_mem_gb if options.gpus_per_node else None,
            reserve_gib=options.reserve_gb,
            entropies=config.learner.flash_reinforce.negative_token_fraction < 1,
            sync_bucket_bytes=config.weights.bucket_mib * 2**20,
            sync_overlap=config.weights.overlap,
        )
    except LayoutError as error:
        raise LaunchError(f"learner layout on {world} ranks: {error}") from None
    recompute = config.learner.recompute
    if plan.fits(recompute) is False:
        least = plan.least_recompute()
        remedy = f"learner.recompute={least} fits" if least else "no recompute setting fits"
        raise LaunchError(
            f"the learner layout does not fit in GPU memory with learner.recompute={recompute} "
            f"({remedy}):\n{describe(plan)}"
        )
    return plan


def sbatch_directives(job: SlurmJob) -> list[str]:
    o = job.options
    flags = [
        f"--job-name={o.job_name}",
        f"--nodes={job.nodes}",
        "--ntasks-per-node=1",
        f"--output={job.run_dir}/logs/slurm-%j.out",
        "--open-mode=append",  # a requeued run appends to the same log
        "--requeue",
        f"--signal=B:USR1@{o.signal_lead_s}",
    ]
    if o.gpus_per_node:
        flags.append(f"--gpus-per-node={o.gpus_per_node}")
    named = {"partition": o.partition, "account": o.account, "time": o.time}
    flags += [f"--{name}={value}" for name, value in named.items() if value]
    if o.exclusive:
        flags += ["--exclusive", "--mem=0"]  # --exclusive alone leaves memory at the default
    else:
        flags += [f"--cpus-per-task={o.cpus_per_node}", f"--mem={_memory_mib(o)}M"]
    return flags + list(o.sbatch_args)


def _memory_mib(o: SlurmOptions) -> int:
    """mem_per_node_gb in MiB: a job that shares its nodes has it (_check_node_share)."""
    if o.mem_per_node_gb is None:
        raise LaunchError("a job that shares its nodes needs --mem-per-node-gb")
    return int(o.mem_per_node_gb * 1024)


def container_flags(options: SlurmOptions) -> list[str]:
    """pyxis flags for every srun; none without an image."""
    if options.container_image is None:
        return []
    flags = [f"--container-image={options.container_image}"]
    if options.container_mounts:
        flags.append(f"--container-mounts={options.container_mounts}")
    if options.container_workdir:
        flags.append(f"--container-workdir={options.container_workdir}")
    return flags


def settings(job: SlurmJob) -> dict[str, str | list[str]]:
    """The MFR_* variables slurm/job.sh reads (lists become bash arrays)."""
    o = job.options
    return dict(
        MFR_REPO=str(REPO_ROOT),
        MFR_PYTHON=job.python,
        MFR_RECIPE=str(job.recipe),
        MFR_RUN_DIR=str(job.run_dir),
        MFR_OVERRIDES=list(job.overrides),
        MFR_HF_DIR=job.config.model.hf_dir,
        MFR_ROLLOUT_NODES=str(o.rollout_nodes),
        MFR_LEARNER_NODES=str(o.learner_nodes),
        MFR_PROCS_PER_NODE=str(job.procs_per_node),
        MFR_ENGINE=job.engine,
        MFR_SERVERS_PER_NODE=str(job.servers_per_node),
        MFR_SERVER_GPUS=str(job.server_gpus),
        MFR_SERVER_THREADS=str(o.server_threads),
        MFR_SERVER_ARGS=list(o.server_args),
        MFR_ROUTED_EXPERTS=str(int(job.config.learner.routing_replay)),
        MFR_PORT_BASE=str(o.port_base),
        MFR_HEALTH_TIMEOUT_S=str(o.health_timeout_s),
        MFR_CPUS_PER_NODE=str(o.cpus_per_node or ""),
        MFR_CONTAINER=container_flags(o),
        MFR_ENV=[*NCCL_ENV, *o.env],
    )


def render_script(job: SlurmJob) -> str:
    """The batch script: #SBATCH lines, the settings, then slurm/job.sh verbatim."""
    lines = ["#!/bin/bash"]
    lines += [f"#SBATCH {flag}" for flag in sbatch_directives(job)]
    lines.append(f"# Rendered by megatron_fr/launch/slurm.py for {job.recipe}; body: slurm/job.sh")
    for name, value in settings(job).items():
        if isinstance(value, list):
            lines.append(f"{name}=({' '.join(shlex.quote(item) for item in value)})")
        else:
            lines.append(f"{name}={shlex.quote(value)}")
    return "\n".join(lines) + "\n\n" + JOB_BODY.read_text()


def summary(job: SlurmJob) -> str:
    """The plan in words: nodes, servers, ranks, layout, preemption."""
    o, ports = job.options, job.server_ports
    r, n = job.config.cluster.rollout_nodes, job.nodes
    server = (
        f"{job.server_gpus} GPU(s) each (SGLang TP{job.server_gpus})"
        if job.server_gpus
        else f"{o.server_threads} thread(s) each"
    )
    return "\n".join(
        [
            f"recipe    {job.recipe} ({job.config.steps} steps, B {job.config.buffer.batch_size},"
            f" max lag {job.config.buffer.max_lag})",
            f"run dir   {job.run_dir} (logs: logs/slurm-<job>.<restart>/)",
            f"nodes     {n}: rollout {_span(1, r)}, learner {_span(r + 1, n)};"
            f" {o.gpus_per_node} GPU(s) per node, " + _share(o),
            f"servers   {r * job.servers_per_node} ({job.servers_per_node} per rollout node,"
            f" {job.engine} engine, {server}); ports {ports[0]}-{ports[-1]}",
            f"learner   {job.learner_ranks} ranks = {o.learner_nodes} node(s) x"
            f" {job.procs_per_node}; torchrun at <learner node 1>:{o.port_base},"
            f" weight group :{o.port_base + 10}",
            "layout    " + describe(job.plan).replace("\n", "\n          "),
            f"preempt   USR1 {o.signal_lead_s}s before the time limit ({o.time or 'none set'})"
            " -> STOP -> checkpoint -> scontrol requeue -> the rerun resumes",
            f"container {' '.join(container_flags(o)) or 'none'}",
            f"env       {' '.join([*NCCL_ENV, *o.env])}",
        ]
    )


def _share(o: SlurmOptions) -> str:
    if o.exclusive:
        return "whole nodes (exclusive)"
    return f"{o.cpus_per_node} CPU(s) and {_memory_mib(o)} MiB each"


def _span(first: int, last: int) -> str:
    return f"node {first}" if first == last else f"nodes {first}-{last}"
